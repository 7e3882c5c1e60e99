"""The whole graph as a user would write it in plain JAX, beside the searched plans, measured side by side.

A ``WholeProgram`` is one function of the graph's inputs and parameters
(dicts, as a ``CompiledPlan`` takes them) with the layouts it reads them in;
XLA partitions the rest (a Llama block under Megatron tensor parallelism, or
its sequence-parallel variant: ``models.block_graph.whole_blocks``).

``choose`` is the graph's final round: the searched plans and the whole
programs each get fresh random inputs in their own layouts, are checked
against the first whole program (its output, and in training every
gradient), then timed side by side (``tuner.decide.final_round``:
interleaved rounds until resolved, the forward or a training step). The
whole programs are its plain candidates: a plan is chosen only when it is
faster than the best of them beyond the noise and by more than
``decide.PLAIN_MARGIN``, so a plan measured slower is never chosen. The cost
model cannot price a whole program (XLA's partitioning of it is not
modeled): without measuring, the search's plan stands alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmercury.graph.dag import INPUT
from jaxmercury.graph.execute import compile_plan
from jaxmercury.tuner import decide, measure
from jaxmercury.tuner.plain import platform_of


@dataclasses.dataclass(frozen=True)
class WholeProgram:
  """The graph as one plain function.

  Attributes:
    name: e.g. ``"xla_megatron_tp"``.
    fn: ``fn(inputs, params) -> outputs``, dicts keyed by the graph's input nodes, parameter keys and output
      nodes, on global arrays (to run inside ``jax.jit``).
    param_specs: the layout each parameter is read in (keys absent: replicated).
    input_specs: the layout each input is read in (keys absent: replicated).
  """

  name: str
  fn: Callable
  param_specs: Mapping = dataclasses.field(default_factory=dict)
  input_specs: Mapping = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Contestant:
  """A searched plan or a whole program, ready to run: ``fn(inputs, params)`` and the layouts it reads them in."""

  name: str
  fn: Callable
  param_specs: Mapping
  input_specs: Mapping
  plan: object = None  # the GraphPlan, or None for a whole program

  @property
  def plain(self) -> bool:
    return self.plan is None


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``choose`` found.

  Attributes:
    chosen: the contestant that runs (``chosen.plan``: a searched plan; else a whole program).
    contestants: every contestant.
    failed: per contestant that did not run or whose values differ from the first whole program's, why.
    decision: the final round's verdict (None when one contestant was left).
  """

  chosen: Contestant
  contestants: tuple
  failed: dict
  decision: decide.Decision | None

  @property
  def plan(self):
    return self.chosen.plan

  def summary(self) -> str:
    line = self.decision.summary() if self.decision else f"{self.chosen.name}: the only contestant that passed"
    for name, why in self.failed.items():
      line += f"; {name} failed ({why})"
    return line


def from_plan(name: str, plan) -> Contestant:
  """A searched plan as a contestant: its compiled function, its parameters' layouts, the graph inputs' layouts."""
  compiled = compile_plan(plan)
  inputs = {n.name: n.candidates[0].output.spec for n in plan.graph.nodes if n.kind == INPUT}
  return Contestant(name, compiled.fn, dict(compiled.param_specs), inputs, plan)


def from_whole(whole: WholeProgram) -> Contestant:
  return Contestant(whole.name, whole.fn, dict(whole.param_specs), dict(whole.input_specs))


def _placed(tree: dict, specs: Mapping, mesh) -> dict:
  return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k) or PartitionSpec())) for k, v in tree.items()}


def _ready(c: Contestant, inputs, params, mesh, cotangent):
  """``(call of no arguments, first results)``: ``c`` compiled for its layouts (a training step when
  ``cotangent``), run once."""
  args = [_placed(inputs, c.input_specs, mesh), _placed(params, c.param_specs, mesh)]
  fn = jax.jit(c.fn) if cotangent is None else measure.training_step(c.fn)
  if cotangent is not None:
    args.append(cotangent)
  compiled = fn.lower(*args).compile()
  return functools.partial(compiled, *args), jax.block_until_ready(compiled(*args))


def _differs(got, want, training: bool, platform: str) -> str | None:
  """Why ``got`` (the outputs; in training also every gradient, on devices of ``platform``) is not ``want``'s
  values, or None."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  if len(got) != len(want):
    return f"{len(got)} results where the reference has {len(want)}"
  for k, (a, b) in enumerate(zip(got, want)):
    if a.shape != b.shape:
      return f"result {k} has shape {a.shape}, not {b.shape}"
    err = measure.rel_err(a, b)
    tol = (measure.gradient_tolerance if training else measure.tolerance)(b.dtype, platform)
    if not np.isfinite(err) or err > tol:
      return f"relative error {err:.2e} in result {k}"
  return None


def choose(plans, wholes: Sequence[WholeProgram], inputs: dict, params: dict, *, training: bool = False,
           iters: int = 10, budget_s: float = 3.0, key=None, log=print) -> Choice:
  """The faster of the searched plans and the whole programs, measured side by side (module docstring).

  Args:
    plans: name -> ``GraphPlan`` (or one plan, named ``"plan"``): the searched plans (of graphs with the same
      inputs, parameters and outputs).
    wholes: the graph as plain functions; the first is the reference every contestant is checked against.
    inputs: the graph's inputs by input node (values; each contestant gets them in its layouts).
    params: the parameters by key.
    training: compare training steps (each contestant's forward and its vjp for a random output cotangent,
      every input's and parameter's gradient checked) instead of forwards.
    iters: interleaved rounds between two comparisons.
    budget_s: seconds after which the round starts no new batch (``decide.final_round``).
    key: PRNG key for the training step's cotangent; default a fixed one.
    log: progress printer.

  Returns:
    The ``Choice``.

  Raises:
    ValueError: no plan or no whole program is given, or the first whole program does not run (nothing to check
      the plans against).
  """
  plans = {"plan": plans} if not isinstance(plans, Mapping) else dict(plans)
  if not wholes or not plans:
    raise ValueError("choose needs a plan and a whole program (the plain graph the plan must beat)")
  entrants = [from_whole(w) for w in wholes] + [from_plan(n, p) for n, p in plans.items()]
  mesh = next(iter(plans.values())).graph.mesh
  cotangent = None
  if training:
    shapes = jax.eval_shape(entrants[0].fn, inputs, params)
    keys = jax.random.split(key if key is not None else jax.random.key(0), len(jax.tree.leaves(shapes)))
    leaves = [jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype)
              for k, s in zip(keys, jax.tree.leaves(shapes))]
    cotangent = jax.tree.unflatten(jax.tree.structure(shapes), leaves)
  calls, failed, reference = {}, {}, None
  for c in entrants:
    try:
      call, results = _ready(c, inputs, params, mesh, cotangent)
    except Exception as e:  # a contestant that does not compile or run loses, with the reason
      failed[c.name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
      log(f"  {c.name}: {failed[c.name]}")
      continue
    if reference is None:
      if c is not entrants[0]:
        raise ValueError(f"choose: {entrants[0].name} does not run ({failed[entrants[0].name]}); nothing to "
                         "check the plans against")
      reference = results
    else:
      why = _differs(results, reference, training, platform_of(mesh))
      if why is not None:
        failed[c.name] = f"differs from {entrants[0].name}: {why}"
        log(f"  {c.name}: {failed[c.name]}")
        continue
    calls[c.name] = call
  by_name = {c.name: c for c in entrants}
  if len(calls) == 1:
    return Choice(by_name[next(iter(calls))], tuple(entrants), failed, None)
  verdict = decide.final_round(calls, plain=[n for n in calls if by_name[n].plain],
                               order=[n for n in calls if not by_name[n].plain], batch=iters, budget_s=budget_s)
  if verdict is None:
    raise ValueError("choose: every contestant failed while being timed")
  failed.update(verdict.failed)
  what = "training steps" if training else "forwards"
  log(f"graph final round ({what}): " + ", ".join(f"{n} {verdict.median_ms(n):.3f} ms" for n in verdict.times_ms))
  log(f"chosen: {verdict.summary()}")
  return Choice(by_name[verdict.winner], tuple(entrants), failed, verdict)

