"""Running a plan: each operator's schedule, each glue function, each edge's fused collectives.

``compile_plan(plan)`` returns ``f(inputs, params) -> outputs`` on global
arrays (dicts by node / parameter key), to call inside ``jax.jit``. A partial
output is reduced by its producer's schedule: a leading ``reduce_scatter`` of
the fused edge becomes ``shard(output, loop, axis=...)`` on that schedule, an
``all_reduce`` stays the schedule's own; the rest of the edge runs as a
``shard_map`` of the fused collectives. It is differentiable.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxmercury.analysis import collectives as cl
from jaxmercury.analysis.layouts import Layout, view
from jaxmercury.graph.dag import GLUE, INPUT, OP, OUTPUT
from jaxmercury.lowering import types
from jaxmercury.lowering.collectives import reshard_program


def _split_reductions(edge, partial):
  """The edge's leading reduction steps (one per partial level) and the rest."""
  k = 0
  while k < len(edge.fused) and edge.fused[k].kind in (cl.ALL_REDUCE, cl.REDUCE_SCATTER) \
      and edge.fused[k].level in partial:
    k += 1
  if k != len(partial):
    raise ValueError(f"edge {edge.producer} -> {edge.consumer}: the fused collectives {edge.fused} do not start "
                     f"by reducing the partial levels {partial}")
  return list(edge.fused[:k]), list(edge.fused[k:])


def realize(candidate, reductions, producer_shape, consumer_shape, sizes):
  """The schedule that runs ``candidate`` with its partial output reduced by ``reductions``.

  Returns:
    ``(schedule, output layout over the producer's shape)``.
  """
  schedule = candidate.schedule
  if not any(r.kind == cl.REDUCE_SCATTER for r in reductions):
    return schedule, Layout(candidate.output.dims)
  prog = schedule.program
  out = prog.writes
  loops = {red.level: red.loop for red in schedule.plan().reductions}
  # the edge's steps act in the consumer's view: carry the layout after them back to the producer's shape
  start = view(candidate.output, producer_shape, consumer_shape, sizes)
  after = cl.trajectory(start, reductions)[-1]
  back = view(after, consumer_shape, producer_shape, sizes)
  if back is None:
    raise ValueError(f"{candidate.name}: the reduce-scatter's layout {after} has no counterpart in the output's shape")
  variant = schedule.copy()
  for r in reductions:
    if r.kind == cl.REDUCE_SCATTER:
      dim = next(d for d, e in enumerate(back.dims) if r.level in e)
      variant.shard(out.name, loops[r.level], axis=out.dims[dim][0].name)
  return variant.with_layouts(schedule.in_shardings, back.spec), back


@dataclasses.dataclass
class CompiledPlan:
  """A plan ready to run; ``param_specs`` are the layouts the parameters are read in."""

  plan: object
  param_specs: dict
  fn: object

  def __call__(self, inputs: dict, params: dict) -> dict:
    return self.fn(inputs, params)

  def param_shardings(self) -> dict:
    mesh = self.plan.graph.mesh
    return {k: NamedSharding(mesh, s) for k, s in self.param_specs.items()}


def compile_plan(plan) -> CompiledPlan:
  """Builds the function that runs ``plan`` (see the module docstring)."""
  graph = plan.graph
  mesh, sizes = graph.mesh, graph.sizes
  edge_of = {(e.producer, e.consumer, e.index): e for e in plan.edges}
  produced = {}  # node -> (schedule or None, output layout over its shape)
  moves = {}  # (producer, consumer, index) -> (function, layout)
  param_specs = {}
  for node in graph.nodes:
    cand = plan.choice[node.name]
    if node.kind == OP:
      keys = {b.name: ref for b, (kind, ref) in zip(node.program.reads, node.reads) if kind == "param"}
      for buf, spec in cand.params:
        param_specs[keys[buf]] = spec
    if node.kind in (OP, INPUT, GLUE):
      outs = [edge_of[(node.name, c, i)] for c, i in graph.consumers(node.name)]
      if cand.output.partial:
        if node.kind != OP or len(outs) != 1:
          raise ValueError(f"node {node.name!r}: a partial output needs one consumer and an operator to reduce it")
        reductions, rest = _split_reductions(outs[0], cand.output.partial)
        consumer = graph.node(outs[0].consumer)
        schedule, layout = realize(cand, reductions, node.shape, consumer.input_shapes[outs[0].index], sizes)
        produced[node.name] = (schedule, layout)
        view_layout = cl.trajectory(outs[0].src, reductions)[-1]
        moves[(node.name, outs[0].consumer, outs[0].index)] = reshard_program(mesh, view_layout, rest)
      else:
        produced[node.name] = (cand.schedule, cand.output)
        for e in outs:
          moves[(e.producer, e.consumer, e.index)] = reshard_program(mesh, e.src, list(e.fused))
  compiled = {name: s.compile() for name, (s, _) in produced.items() if s is not None}

  def constrain(x, layout):
    return types.constrain(x, mesh, layout.spec)

  def run(inputs: dict, params: dict) -> dict:
    values, results, moved = {}, {}, {}

    def arrive(node, i):
      prod = node.inputs[i]
      edge = edge_of[(prod, node.name, i)]
      if edge.key not in moved:  # consumers wanting the same layout share one resharding
        move, _ = moves[(prod, node.name, i)]
        moved[edge.key] = move(jnp.reshape(values[prod], node.input_shapes[i]))
      return moved[edge.key]

    for node in graph.nodes:
      cand = plan.choice[node.name]
      if node.kind == INPUT:
        values[node.name] = constrain(inputs[node.name], cand.output)
      elif node.kind == OP:
        args = []
        for kind, ref in node.reads:
          if kind == "input":
            args.append(arrive(node, ref))
          else:
            args.append(types.constrain(params[ref], mesh, param_specs[ref]))
        values[node.name] = compiled[node.name](*args)
      elif node.kind == GLUE:
        xs = [arrive(node, i) for i in range(len(node.inputs))]
        y = node.fn(*xs, *[params[k] for k in node.param_keys])
        values[node.name] = constrain(y, cand.output)
      elif node.kind == OUTPUT:
        results[node.name] = arrive(node, 0)
    return results

  return CompiledPlan(plan, param_specs, run)

