"""Choosing every node's candidate jointly with the resharding on every edge (Mercury §7.4).

The total time of an assignment is the sum of its candidates' times and of
its edges' times; an edge moves its tensor from the producer's output layout
to the consumer's input layout by the fused collectives
(``fusion.fuse(collectives.naive(src, dst))``), timed by the link model.
Consumers of one tensor that want it in the same layout and shape share one
resharding (the all-gather before q, k and v projections happens once).

With ``training=True`` the objective is a training step's forward and
backward: every node costs its measured forward and backward
(``NodeOption.train_seconds``) where ``measure_candidates(training=True)``
timed it; else an operator costs its forward, its schedule's predicted
backward (``NodeOption.backward_seconds``: the transposed collectives and the
gradients' block products; a fused GEMM's backward is the dual fused GEMM
of the other placement and one local GEMM, a fused ring attention's the
dual programs of its ring on cuDNN) and the
all-reduce of the partial gradients of parameters it keeps whole where it
splits other axes (``NodeOption.grad_sync_seconds``), and glue
``BACKWARD_FACTOR`` times its forward. Every edge costs twice its forward
resharding (the backward runs its transpose: all-gather and reduce-scatter
swap, moving the same bytes). A plan with replicated weights and split
tokens may win the forward and lose training; a fused kernel may win the
forward and lose training to the schedule whose backward it borrows.

``exhaustive`` tries every assignment; ``dynamic`` walks the nodes in
topological order keeping, for each combination of the output layouts of the
tensors still waiting for a consumer (the frontier), the cheapest partial
assignment. Both are exact: an edge's cost depends only on the two layouts it
joins. ``search`` uses ``exhaustive`` when the space is small.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np

from jaxmercury.analysis import collectives as cl
from jaxmercury.analysis.fusion import RULES, fuse
from jaxmercury.analysis.layouts import Layout, view
from jaxmercury.graph.dag import GLUE, INPUT, OP, OUTPUT, Graph
from jaxmercury.graph.options import machine_for

BACKWARD_FACTOR = 3.0  # glue: forward + backward over forward (the backward reads and writes twice as much)


def node_seconds(candidate, training: bool) -> float:
  """A candidate's time in the objective: its forward, or in training its forward and backward (measured or
  predicted)."""
  if not training:
    return candidate.seconds
  if candidate.train_seconds is not None:
    return candidate.train_seconds
  if candidate.backward_seconds is not None:
    return candidate.seconds + candidate.backward_seconds + candidate.grad_sync_seconds
  return BACKWARD_FACTOR * candidate.seconds + candidate.grad_sync_seconds


@dataclasses.dataclass(frozen=True)
class EdgePlan:
  """The resharding on one edge.

  Attributes:
    producer: producer node.
    consumer: consumer node.
    index: the consumer's input index.
    shape: the tensor's shape as the consumer reads it.
    src: the producer's output layout, carried into that shape.
    dst: the consumer's input layout.
    naive: synchronize-then-slice collectives.
    fused: the collectives after fusion.
    rules: fusion rules applied.
    naive_bytes: bytes one device sends for ``naive``.
    fused_bytes: bytes one device sends for ``fused``.
    seconds: time of ``fused``; 0 when ``shared``.
    shared: an earlier consumer of the producer already moved the tensor
      into this layout and shape; this edge reuses it.
  """

  producer: str
  consumer: str
  index: int
  shape: tuple
  src: Layout
  dst: Layout
  naive: tuple
  fused: tuple
  rules: tuple
  naive_bytes: float
  fused_bytes: float
  seconds: float
  shared: bool = False

  @property
  def key(self) -> tuple:
    """What two edges must agree on to share a resharding."""
    return (self.producer, self.shape, self.dst)


@dataclasses.dataclass
class GraphPlan:
  """The chosen candidate of every node and the resharding of every edge."""

  graph: Graph
  choice: dict  # node name -> NodeOption
  edges: list  # EdgePlan
  seconds: float
  method: str
  explored: int
  training: bool = False

  @property
  def node_seconds(self) -> float:
    return sum(node_seconds(c, self.training) for c in self.choice.values())

  @property
  def edge_seconds(self) -> float:
    return sum(e.seconds for e in self.edges)

  def __str__(self) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in self.graph.sizes.items())
    objective = "training step (forward + backward)" if self.training else "forward"
    lines = [f"graph plan on mesh ({sizes}), {objective}: {self.seconds * 1e3:.4f} ms predicted "
             f"({self.node_seconds * 1e3:.4f} ms in operators, {self.edge_seconds * 1e3:.4f} ms on edges; "
             f"{self.method}, {self.explored} evaluations)", "operators:"]
    for node in self.graph.nodes:
      c = self.choice.get(node.name)
      if c is None or node.kind == OUTPUT:
        continue
      ins = " ".join(str(lay) for lay in c.inputs) or "-"
      sync = ""
      if self.training and c.train_seconds is not None:
        sync = f", forward + backward {c.train_seconds * 1e3:.4f} ms (measured)"
      elif self.training and c.backward_seconds is not None:
        sync = f" + {c.backward_seconds * 1e3:.4f} ms backward (predicted)"
      if self.training and c.train_seconds is None and c.grad_sync_seconds:
        sync += f" + {c.grad_sync_seconds * 1e3:.4f} ms gradient all-reduce"
      lines.append(f"  {node.name:<18} {node.kind:<6} {c.name:<34} in {ins:<32} out {str(c.output):<22} "
                   f"{c.seconds * 1e3:9.4f} ms ({c.source}){sync}")
    lines.append("edges (after fusion; bytes one device sends, fused / naive):")
    for e in self.edges:
      moved = "(shared with an earlier edge)" if e.shared else ", ".join(map(str, e.fused)) or "nothing"
      rules = f"  [{', '.join(e.rules)}]" if e.rules else ""
      fused = "-" if e.shared else _bytes(e.fused_bytes)
      lines.append(f"  {e.producer + ' -> ' + e.consumer:<36} {str(e.src):<24} -> {str(e.dst):<16} "
                   f"{moved:<40} {fused} / {_bytes(e.naive_bytes)}{rules}")
    return "\n".join(lines)


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} GiB"


class _Edges:
  """Edge plans, memoized by (shapes, dtype, layouts)."""

  def __init__(self, graph: Graph, machines, scale: float = 1.0):
    self.graph = graph
    self.machine = machine_for(machines, "*")
    self.scale = scale  # training: the forward resharding and its transpose
    self.sizes = graph.sizes
    self.multi = {n.name: len(graph.consumers(n.name)) > 1 for n in graph.nodes}

  def plan(self, producer: str, consumer: str, index: int, src_layout: Layout, dst: Layout) -> EdgePlan | None:
    p, c = self.graph.node(producer), self.graph.node(consumer)
    if src_layout.partial and self.multi[producer]:
      return None  # one reduction cannot serve several consumers' edges
    found = self._plan(p.shape, c.input_shapes[index], np.dtype(p.dtype).itemsize, src_layout, dst)
    return None if found is None else dataclasses.replace(found, producer=producer, consumer=consumer, index=index)

  @functools.cache  # noqa: B019  (one planner per search: the cache goes with it)
  def _plan(self, shape_from, shape_to, itemsize, src_layout, dst):
    src = view(src_layout, shape_from, shape_to, self.sizes)
    if src is None or not dst.fits(shape_to, self.sizes):
      return None
    naive = cl.naive(src, dst)
    fused, rules = fuse(src, naive)
    if src.partial and not self._realizable(src, fused, shape_to, shape_from):
      # the producer's schedule reduces in its own shape: keep the all-reduce if the scatter has no counterpart there
      fused, rules = fuse(src, naive, [r for r in RULES if r.first != cl.ALL_REDUCE])
    return EdgePlan("", "", 0, tuple(shape_to), src, dst, tuple(naive), tuple(fused), tuple(rules),
                    cl.sequence_bytes(src, naive, shape_to, itemsize, self.sizes),
                    cl.sequence_bytes(src, fused, shape_to, itemsize, self.sizes),
                    self.scale * cl.sequence_seconds(src, fused, shape_to, itemsize, self.machine, self.sizes))

  def _realizable(self, src, fused, shape_to, shape_from) -> bool:
    """Whether the layout after the leading reductions exists in the producer's shape."""
    k = 0
    while k < len(fused) and fused[k].kind in (cl.ALL_REDUCE, cl.REDUCE_SCATTER):
      k += 1
    after = cl.trajectory(src, fused[:k])[-1]
    return view(after, shape_to, shape_from, self.sizes) is not None


def _check(graph: Graph):
  kinds = {INPUT, OP, GLUE, OUTPUT}
  for n in graph.nodes:
    if n.kind not in kinds:
      raise ValueError(f"node {n.name!r}: unknown kind {n.kind!r}")


def _edges(graph: Graph, machines, training: bool) -> _Edges:
  return _Edges(graph, machines, 2.0 if training else 1.0)


def exhaustive(graph: Graph, machines, *, training: bool = False) -> GraphPlan:
  """Tries every joint assignment of candidates (``training``: see the module docstring)."""
  _check(graph)
  edges = _edges(graph, machines, training)
  nodes = graph.nodes
  index = {n.name: k for k, n in enumerate(nodes)}
  best, best_pick, explored = math.inf, None, 0
  for pick in itertools.product(*[range(len(n.candidates)) for n in nodes]):
    explored += 1
    total = sum(node_seconds(n.candidates[i], training) for n, i in zip(nodes, pick))
    done = set()
    for prod, cons, k in graph.edges():
      out = nodes[index[prod]].candidates[pick[index[prod]]].output
      dst = nodes[index[cons]].candidates[pick[index[cons]]].inputs[k]
      e = edges.plan(prod, cons, k, out, dst)
      if e is None:
        total = math.inf
      elif e.key not in done:
        done.add(e.key)
        total += e.seconds
      if total >= best:
        break
    if total < best:
      best, best_pick = total, pick
  if best_pick is None:
    raise ValueError("no assignment connects every edge")
  return _finish(graph, edges, {n.name: n.candidates[i] for n, i in zip(nodes, best_pick)}, "exhaustive search",
                 explored, training)


def dynamic(graph: Graph, machines, *, training: bool = False) -> GraphPlan:
  """Dynamic programming over the nodes in order (``training``: see the module docstring).

  The state is, for every tensor still waiting for a consumer, its output
  layout and the (shape, layout) pairs it was already moved into.
  """
  _check(graph)
  edges = _edges(graph, machines, training)
  last_use = {}
  for k, n in enumerate(graph.nodes):
    for p in n.inputs:
      last_use[p] = k
  layers = []
  frontier = {(): (0.0, None, None)}  # key -> (cost, previous key, candidate index)
  explored = 0
  for k, node in enumerate(graph.nodes):
    nxt = {}
    for key, (cost, _, _) in frontier.items():
      live = dict(key)
      for ci, cand in enumerate(node.candidates):
        explored += 1
        total, moved = cost + node_seconds(cand, training), {p: set(done) for p, (_, done) in live.items()}
        for i, prod in enumerate(node.inputs):
          e = edges.plan(prod, node.name, i, live[prod][0], cand.inputs[i])
          if e is None:
            total = math.inf
            break
          if (e.shape, e.dst) not in moved[prod]:
            moved[prod].add((e.shape, e.dst))
            total += e.seconds
        if total == math.inf:
          continue
        rest = {p: (lay, frozenset(moved[p])) for p, (lay, _) in live.items() if last_use.get(p) != k}
        if node.name in last_use:
          rest[node.name] = (cand.output, frozenset())
        new_key = tuple(sorted(rest.items(), key=lambda kv: kv[0]))
        if new_key not in nxt or total < nxt[new_key][0]:
          nxt[new_key] = (total, key, ci)
    if not nxt:
      raise ValueError(f"no assignment connects the edges into node {node.name!r}")
    layers.append(nxt)
    frontier = nxt
  key = min(frontier, key=lambda kk: frontier[kk][0])
  choice = {}
  for node, layer in zip(reversed(graph.nodes), reversed(layers)):
    _, prev, ci = layer[key]
    choice[node.name] = node.candidates[ci]
    key = prev
  return _finish(graph, edges, choice, "dynamic programming over the frontier", explored, training)


def _finish(graph, edges, choice, method, explored, training: bool = False) -> GraphPlan:
  plans, done = [], set()
  for prod, cons, k in graph.edges():
    e = edges.plan(prod, cons, k, choice[prod].output, choice[cons].inputs[k])
    if e.key in done and e.fused:
      e = dataclasses.replace(e, seconds=0.0, shared=True)
    done.add(e.key)
    plans.append(e)
  total = sum(node_seconds(c, training) for c in choice.values()) + sum(e.seconds for e in plans)
  return GraphPlan(graph, choice, plans, total, method, explored, training)


def search(graph: Graph, machines, *, exhaustive_limit: int = 4096, training: bool = False) -> GraphPlan:
  """The cheapest plan: ``exhaustive`` when the space has at most ``exhaustive_limit`` assignments, else ``dynamic``.

  ``training``: minimize a training step's time instead of the forward's (module docstring).
  """
  if graph.space_size() <= exhaustive_limit:
    return exhaustive(graph, machines, training=training)
  return dynamic(graph, machines, training=training)


def fixed(graph: Graph, machines, choice: dict, *, training: bool = False) -> GraphPlan:
  """The plan of a given assignment (for comparisons)."""
  return _finish(graph, _edges(graph, machines, training), dict(choice), "given assignment", 1, training)

