"""The check every routed model passes: decorated and undecorated, trained side by side.

``train_alike(plain, routed, loss, batch, mesh=mesh)`` runs three optimizer
steps (``optax.adam`` through ``nnx.Optimizer``) of the undecorated model and
of its routed copy. Each step is one jitted program: forward, gradients and
the optimizer's update, traced and compiled once and run every step. It
compares the first step's outputs and gradients (tightly), the losses of every
step, the parameters after the last, and the sharding type of every output,
gradient, parameter and optimizer state with the undecorated program's, after
every step. With Explicit axes inside ``jax.set_mesh`` a type that changed
would also make the next step trace again: the routed step must run the
program compiled first, every step.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from conftest import assert_grads_match, assert_trains_alike, rel_err
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm


@dataclasses.dataclass
class Trained:
  """What ``train_alike`` saw of the routed model.

  Attributes:
    losses: its loss at each step (the undecorated model's: ``want``).
    want: the undecorated model's losses.
    text: its step's lowered program (StableHLO), for the collectives it runs.
    traces: how many times its step was traced (1: every step ran the program compiled first).
    params: its parameters after the last step.
  """

  losses: list
  want: list
  text: str
  traces: int
  params: object


def spec(x) -> tuple:
  """``x``'s sharding type as a tuple of mesh-axis entries, trailing unsplit dims left out (an array of no mesh,
  or of Auto axes, is unsplit)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  if getattr(sharding, "mesh", None) is None or sharding.mesh.empty:
    return ()
  entries = list(sharding.spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def _specs(tree) -> dict:
  return {jax.tree_util.keystr(path): spec(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _mesh_set() -> bool:
  return not jax.sharding.get_abstract_mesh().empty


def _auto(mesh) -> bool:
  return all(t == AxisType.Auto for t in mesh.axis_types)


def _run(model, loss, batch, mesh, steps: int, learning_rate: float, lower: bool):
  """``steps`` steps of ``model``: ``(losses, first outputs, first gradients, states after each step, lowered
  text, traces)``; a state is ``(params, optimizer state)``."""
  optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  replicated = NamedSharding(mesh, P())
  if _auto(mesh):  # Auto axes: the same input shardings every step (types do not carry them)
    state = jax.device_put(state, replicated)
  traces = []

  def step(state, batch):
    traces.append(1)
    model, optimizer = nnx.merge(graphdef, state)
    (value, out), grads = nnx.value_and_grad(loss, has_aux=True)(model, *batch)
    optimizer.update(model, grads)
    new = nnx.state((model, optimizer))
    if _auto(mesh):
      new = jax.lax.with_sharding_constraint(new, replicated)
    return new, value, out, grads

  jitted = jax.jit(step)
  text = jitted.lower(state, batch).as_text() if lower else ""
  losses, states, first = [], [], None
  for _ in range(steps):
    state, value, out, grads = jitted(state, batch)
    first = first or (out, grads)
    losses.append(float(value))
    m, opt = nnx.merge(graphdef, state)
    states.append((nnx.state(m, nnx.Param), nnx.state(opt)))
  return losses, first[0], first[1], states, text, len(traces)


def train_alike(plain, routed, loss, batch, *, mesh, steps: int = 3, learning_rate: float = 1e-2,
                out_tol: float = 1e-5, grad_tol: float = 1e-4, lower: bool = False) -> Trained:
  """Trains ``plain`` and ``routed`` (the same model, undecorated and routed, with equal parameters) ``steps``
  optimizer steps on ``batch``, asserting that they train alike with equal sharding types.

  Args:
    plain, routed: the two models (their variables are left as they were: the steps run on copies).
    loss: ``loss(model, *batch) -> (loss, outputs)``.
    batch: the step's arguments after the model.
    mesh: the mesh ``routed`` runs on.
    lower: also return the routed step's lowered program.
  """
  want, want_out, want_grads, want_states, _, _ = _run(plain, loss, batch, mesh, steps, learning_rate, False)
  got, got_out, got_grads, got_states, text, traces = _run(routed, loss, batch, mesh, steps, learning_rate, lower)
  for a, b in zip(jax.tree.leaves(got_out), jax.tree.leaves(want_out)):
    assert rel_err(a, b) < out_tol, f"outputs differ: rel err {rel_err(a, b):.2e}"
  assert_grads_match(got_grads, want_grads, grad_tol)
  assert_trains_alike(got, want)
  _assert_params_alike(got_states[-1][0], want_states[-1][0], want_grads, steps)
  # sharding types: the outputs', the gradients', then the parameters' and optimizer state's after every step
  assert _specs(got_out) == _specs(want_out)
  assert _specs(got_grads) == _specs(want_grads)
  for i, (g, w) in enumerate(zip(got_states, want_states)):
    assert _specs(g) == _specs(w), f"types after step {i + 1}: {_diff(_specs(g), _specs(w))}"
  if not _auto(mesh) and _mesh_set():
    assert traces == 1, f"the routed step traced {traces} times: a type changed"
  return Trained(got, want, text, traces, got_states[-1][0])


def _assert_params_alike(got, want, grads, steps: int):
  """The parameters after ``steps`` Adam steps, each leaf loosely: Adam moves an element by about the learning
  rate whatever its gradient's size, so one whose gradient is rounding noise (a key bias under softmax has none)
  moves either way: such leaves are left out, and in the others the elements whose first gradient is under a
  thousandth of the leaf's largest (rounding may flip its sign)."""
  grads = {jax.tree_util.keystr(k): np.asarray(g, np.float64) for k, g in jax.tree_util.tree_leaves_with_path(grads)}
  whole = np.sqrt(sum(np.linalg.norm(g) ** 2 for g in grads.values()))
  want = dict(jax.tree_util.tree_leaves_with_path(want))
  for path, a in jax.tree_util.tree_leaves_with_path(got):
    name = jax.tree_util.keystr(path)
    b = np.asarray(want[path], np.float64)
    a = np.asarray(a, np.float64)
    if name in grads:
      g = np.abs(grads[name])
      if np.linalg.norm(g) <= 1e-5 * whole:
        continue
      kept = g > 1e-3 * g.max()
      a, b = np.where(kept, a, 0.0), np.where(kept, b, 0.0)
    err = rel_err(a, b)
    assert err < 1e-3, f"{name} differs after {steps} steps: rel err {err:.2e}"


def _diff(got: dict, want: dict) -> dict:
  return {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}


def store_winners(db, mesh, report, strategy: str = "ring", kind: str = "attention"):
  """``strategy`` stored in ``db`` as the winner of every routed ``kind`` call of ``report`` (an explain): the
  routes then run it, really distributed (untuned, a route may run the plain program)."""
  ok = jm.tuner.measure.Measurement(jm.tuner.measure.OK, 1.0)
  for e in report.of_kind(kind):
    if e.program is not None:  # routed, or plain until tuned
      winner = jm.tuner.Candidate(strategy, jm.library(e.program, mesh)[strategy], 0.5, 1024, ok)
      db.store(e.program, mesh, winner, [winner])

