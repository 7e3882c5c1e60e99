"""Measured operator times for the graph search: every operator candidate timed on the mesh.

The cost model prices an operator candidate from machine figures; where its
assumptions fail (a ``ppermute`` ring that XLA does not overlap with the
GEMMs, a small GEMM far from the peak rate) the search picks the wrong
schedule. ``measure_candidates`` times each candidate's schedule on the
graph's mesh, side by side with the node's other candidates
(``tuner.measure.interleaved``: fresh random inputs placed in each
candidate's layouts, rounds in turn), and returns the graph with those times.
A candidate with a partial output is timed with its all-reduce (the
schedule that runs it performs one), but that reduction belongs to the edge,
which prices it whether it stays an all-reduce or becomes a reduce-scatter:
its median is scaled by the predicted share of the node itself,
``node / (node + all-reduce)``, as database times are. (Subtracting the
predicted all-reduce instead left near-zero times wherever the prediction
overestimated it, and the search then chose those candidates.) Nodes running
the same program with the same candidates (``wk`` and ``wv``) are timed once.
With ``training=True`` each candidate's forward and backward (its ``vjp`` on
a random cotangent, the gradient all-reduce included) is timed the same way,
so that a training search needs no backward-to-forward ratio.
"""

from __future__ import annotations

import dataclasses
import statistics

import jax

from jaxmercury.graph.dag import OP, Graph
from jaxmercury.graph.options import machine_for, reduction_seconds
from jaxmercury.tuner import measure


def measure_candidates(graph: Graph, machines, *, iters: int = 5, key=None, log=print,
                       cache: dict | None = None, training: bool = False) -> Graph:
  """A copy of ``graph`` whose operator candidates carry measured seconds (``source="measured"``).

  Args:
    graph: the graph; its mesh must hold devices (not an ``AbstractMesh``).
    machines: the figures the candidates were priced with (for the partial
      outputs' reduction, which is subtracted).
    iters: timed rounds per node.
    key: PRNG key for the inputs (default: a fixed key).
    log: called with one line per node timed.
    cache: timings kept across calls (graphs of the same operators on the same
      mesh, e.g. one per residual layout); default none kept.
    training: also time each candidate's forward and backward
      (``NodeOption.train_seconds``, which a training search then uses),
      scaled by the same predicted share as the forward.
  """
  key = key if key is not None else jax.random.key(0)
  done = cache if cache is not None else {}
  nodes = []
  for node in graph.nodes:
    if node.kind != OP:
      nodes.append(node)
      continue
    same = (node.program.name, tuple(b.shape for b in node.program.reads),
            tuple(c.schedule.to_json() for c in node.candidates))
    schedules = {c.name: c.schedule for c in node.candidates}
    machine = machine_for(machines, node.program.pattern)
    share = lambda c, times: _own_share(c, statistics.median(times[c.name]) * 1e-3, machine)
    if same not in done:
      key, sub = jax.random.split(key)
      times = measure.interleaved(schedules, node.program.random_inputs(sub), iters=iters)
      done[same] = [dataclasses.replace(c, seconds=share(c, times), source="measured") for c in node.candidates]
      log(f"{node.name}: " + ", ".join(f"{c.name} {c.seconds * 1e3:.3f} ms" for c in done[same]))
    if training and (same, "training") not in done:
      key, sub, cot = jax.random.split(key, 3)
      steps = measure.interleaved(schedules, node.program.random_inputs(sub), iters=iters, cotangent_key=cot)
      done[same, "training"] = [dataclasses.replace(c, train_seconds=share(c, steps)) for c in done[same]]
      log(f"{node.name} forward + backward: " + ", ".join(f"{c.name} {c.train_seconds * 1e3:.3f} ms"
                                                          for c in done[same, "training"]))
    nodes.append(dataclasses.replace(node, candidates=list(done[(same, "training") if training else same])))
  return Graph(graph.mesh, nodes)


def _own_share(candidate, measured: float, machine) -> float:
  """The measured seconds of ``candidate`` without a partial output's all-reduce (scaled by the predicted share)."""
  if not candidate.output.partial:
    return measured
  reduction = reduction_seconds(candidate.schedule, machine)
  total = candidate.seconds + reduction
  return measured * candidate.seconds / total if total > 0 else measured
