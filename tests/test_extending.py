"""Extending jaxmercury from outside the package: a kernel declared in one object and registered by one line is
seen everywhere a kernel is (kernel_candidates, the tuner's candidates, the cost model, the printer, gradients);
and a schedule's plan is derived once, not again by compile or by differentiating."""

import math

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, make_mesh, rel_err
from plugins import my_attention

import jaxmercury as jm
from jaxmercury.analysis import plan as plans
from jaxmercury.kernels import registry
from jaxmercury.schedules.dual import attention_duals
from jaxmercury.tuner import autotuner, cost


@pytest.fixture
def registered(monkeypatch):
  """``my_attention`` registered for one test (the registry restored after it)."""
  monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
  monkeypatch.setattr(registry, "_BACKWARD_OF", dict(registry._BACKWARD_OF))
  for key in my_attention.TRACED:
    my_attention.TRACED[key] = 0
  jm.kernels.register(my_attention.MY_ATTENTION)  # the one line a user writes
  return my_attention.MY_ATTENTION


def _program(causal=True):
  return jm.programs.attention(1, 4, 2, 64, 64, 16, causal=causal)


def test_an_external_kernel_is_offered_priced_printed_and_differentiated(registered):
  prog, mesh = _program(), make_mesh("8")
  ring = jm.library(prog, mesh)["ring"]
  assert "my_attention" in ring.kernel_candidates()
  assert {str(c) for c in ring.kernel_variants() if c.name == "my_attention"} == {
      "my_attention", "my_attention(chunk=16)"}

  # the tuner's candidates, each library strategy with the kernel
  names = [c.name for c in autotuner.default_candidates(prog, mesh, space=0)]
  assert {"ring [my_attention]", "tree [my_attention]"} <= set(names)

  # the cost model prices its blocks at its own measured rate
  s = ring.copy().patch("my_attention", chunk=16)
  slow = cost.Machine("cpu", 1e9, {"*": 1e12}, 0.0, kernel_flops_per_s={"xla": 1e9, "my_attention": 1e9})
  fast = cost.Machine("cpu", 1e9, {"*": 1e12}, 0.0, kernel_flops_per_s={"xla": 1e9, "my_attention": 4e9})
  assert cost.predict(s, fast) < cost.predict(s, slow)
  assert cost.compute_seconds(s, slow) == pytest.approx(4 * cost.compute_seconds(s, fast))

  # the printer shows it with its configuration; the trace records it as data
  assert "[kernel my_attention(chunk=16)]" in str(s)
  assert s.trace[-1] == {"primitive": "patch", "args": ["my_attention"], "kwargs": {"chunk": 16}}
  assert jm.Schedule.from_json(prog, mesh, s.to_json()).kernel_config == my_attention.Chunks(chunk=16)

  # forward and gradients: its forward blocks, then its declared backward (the dual programs' joint block)
  _, dq, dkv = attention_duals(s)
  assert (dq.kernel, dkv.kernel) == ("my_attention_dq", "my_attention_dkv")
  q, k, v = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  f = s.compile()
  out, vjp = jax.vjp(f, q, k, v)
  ref, ref_vjp = jax.vjp(prog.reference, q, k, v)
  assert rel_err(out, ref) < 1e-5
  for got, want in zip(vjp(cot), ref_vjp(cot)):
    assert rel_err(got, want) < 1e-5
  assert my_attention.TRACED["forward"] > 0 and my_attention.TRACED["joint"] > 0


def test_an_unregistered_kernel_is_nowhere():
  prog, mesh = _program(), make_mesh("8")
  assert "my_attention" not in jm.Schedule(prog, mesh).kernel_candidates()
  with pytest.raises(jm.UnknownNameError, match="no local kernel 'my_attention'"):
    jm.Schedule(prog, mesh).patch("my_attention")


def test_registering_another_kernel_under_a_taken_name_is_refused(registered):
  with pytest.raises(ValueError, match="already registered"):
    jm.kernels.register(jm.kernels.Kernel(name="my_attention", patterns=frozenset({"attention"})))
  jm.kernels.register(registered)  # the same object again: nothing changes


@pytest.fixture
def derivations(monkeypatch):
  """Counts plan derivations per schedule (``analysis.plan.make_plan``)."""
  counts = {}
  original = plans.make_plan

  def counted(schedule):
    counts[id(schedule)] = counts.get(id(schedule), 0) + 1
    return original(schedule)
  monkeypatch.setattr(plans, "make_plan", counted)
  return counts


@pytest.mark.parametrize("kernel", [None, "my_attention"])
def test_a_plan_is_derived_once_per_change_and_never_by_differentiating(registered, derivations, kernel):
  """The README's ring: its primitives derive its plan as they are applied; compile() derives it at most once
  (here not at all) and each schedule it builds (the dual programs') once per primitive that built it;
  ``jax.grad`` of the compiled function derives none."""
  prog, mesh = _program(), make_mesh("8")
  s = jm.Schedule(prog, mesh)
  s.tile("i", 8).parallelize("i0", "x")
  s.tile("j", 8).shift("j0", "i0")
  if kernel:
    s.patch(kernel)
  derivations.clear()
  f = s.compile()
  assert derivations.get(id(s), 0) <= 1
  assert all(n <= len(s.trace) for n in derivations.values()), derivations
  derivations.clear()
  q, k, v = prog.random_inputs(fresh_key())
  grads = jax.grad(lambda *x: jnp.sum(f(*x) ** 2), argnums=(0, 1, 2))(q, k, v)
  assert derivations == {}
  assert all(math.isfinite(float(jnp.sum(g))) for g in grads)
  str(s)
  s.plan()
  assert derivations == {}  # printing and asking again reuse it
