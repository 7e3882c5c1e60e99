"""Gradients of distributed schedules equal jax.grad of the plain reference."""

import contextlib
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import adam_losses, assert_grads_match, assert_trains_alike, fresh_key, make_mesh, rel_err, tolerance
from jax.sharding import AxisType

import jaxmercury as jm
from jaxmercury.tuner import enumerate_schedules

ATTENTION = {
    "mha": dict(batch=1, heads=4, kv_heads=4, q_len=32, kv_len=32, head_dim=8),
    "gqa": dict(batch=2, heads=8, kv_heads=2, q_len=32, kv_len=48, head_dim=8),
    "mqa": dict(batch=1, heads=8, kv_heads=1, q_len=40, kv_len=40, head_dim=8),
}


def _grad_case(prog):
  """Fresh inputs, a random cotangent and the reference's gradients (one jitted program): shared by the schedules of
  ``prog`` a test checks."""
  xs = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape).astype(prog.writes.dtype)
  args = tuple(range(len(xs)))
  want = jax.jit(jax.grad(lambda *a: jnp.sum(prog.reference(*a).astype(jnp.float32) * cot), argnums=args))(*xs)
  return xs, cot, want


def _check_grads(schedule, tol=None, case=None):
  prog = schedule.program
  xs, cot, want = case or _grad_case(prog)
  args = tuple(range(len(xs)))
  f = schedule.compile()
  got = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot), argnums=args))(*xs)
  for buf, g, w in zip(prog.reads, got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    err = rel_err(g, w)
    assert err < (tol or tolerance(prog.writes.dtype)), f"d{buf.name}: rel err {err:.2e}\n{schedule}"


# Pairwise, not the full product: every config with and without the causal mask, and each of them on each mesh.
@pytest.mark.parametrize("mesh_name,config,causal", [("8", "mha", False), ("2x4", "mha", True), ("2x4", "gqa", False),
                                                     ("8", "gqa", True), ("8", "mqa", False), ("2x4", "mqa", True)])
def test_attention_library_gradients(mesh_name, config, causal):
  prog = jm.programs.attention(**ATTENTION[config], causal=causal)
  case = _grad_case(prog)
  for schedule in jm.library(prog, make_mesh(mesh_name)).values():
    _check_grads(schedule, case=case)


@pytest.mark.parametrize("mesh_name", ["8", "4x2"])
def test_matmul_library_gradients(mesh_name):
  prog = jm.programs.matmul(32, 24, 40)
  case = _grad_case(prog)
  for schedule in jm.library(prog, make_mesh(mesh_name)).values():
    _check_grads(schedule, case=case)


def test_bf16_matmul_gradients_are_bf16_gemms():
  """The backward GEMMs take bf16 operands (float32 accumulation), not operands upcast to float32."""
  prog = jm.programs.matmul(64, 48, 32, dtype=jnp.bfloat16)
  case = _grad_case(prog)
  xs = case[0]
  for name, schedule in jm.library(prog, make_mesh("8")).items():
    _check_grads(schedule, tol=2e-2, case=case)
    f = schedule.compile()
    text = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32)), argnums=(0, 1))).lower(*xs).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots, name
    operand_types = [re.findall(r"tensor<(?:\d+x)*(\w+)>", d.split(":")[-1].split("->")[0]) for d in dots]
    assert all(types == ["bf16", "bf16"] for types in operand_types), (name, dots)


@pytest.mark.parametrize("program", ["attention", "matmul"])
def test_tuner_candidate_gradients(program):
  prog = (jm.programs.attention(1, 4, 2, 32, 32, 8, causal=True) if program == "attention"
          else jm.programs.matmul(32, 16, 24))
  space = enumerate_schedules(prog, make_mesh("2x4"))
  case = _grad_case(prog)
  for schedule in random.Random(program).sample(space, 6):
    _check_grads(schedule, case=case)


def test_bf16_ring_gradients():
  prog = jm.programs.attention(1, 4, 4, 64, 64, 16, causal=True, dtype=jnp.bfloat16)
  _check_grads(jm.library(prog, make_mesh("8"))["ring"], tol=3e-2)


def test_backward_is_the_dual_schedule():
  """The ring's gradient travels the ring back; all-gathered K/V get reduce-scattered gradients."""
  prog = jm.programs.attention(1, 4, 4, 32, 32, 8, causal=True)
  lib = jm.library(prog, make_mesh("8"))
  xs = prog.random_inputs(fresh_key())

  def grad_text(schedule):
    f = schedule.compile()
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))).lower(*xs).as_text()

  ring = grad_text(lib["ring"])
  assert "collective_permute" in ring and "all_gather" not in ring and "reduce_scatter" not in ring
  cp = grad_text(lib["context_parallel"])
  assert "all_gather" in cp and "reduce_scatter" in cp
  from jaxmercury.schedules.dual import attention_duals
  _, _, dkv = attention_duals(lib["ring"])
  assert any(r.travel for r in dkv.plan().rings.values())


def test_optax_training_step_matches_reference():
  """A jitted train step through a distributed attention matches the plain model."""
  prog = jm.programs.attention(2, 4, 2, 32, 32, 8, causal=True)
  attend = jm.library(prog, make_mesh("8"))["ring"].compile()
  x = jax.random.normal(fresh_key(), (2, 32, 16))
  target = jax.random.normal(fresh_key(), (2, 32, 4, 8))
  params = {"wq": jax.random.normal(fresh_key(), (16, 4, 8)) * 0.3,
            "wk": jax.random.normal(fresh_key(), (16, 2, 8)) * 0.3,
            "wv": jax.random.normal(fresh_key(), (16, 2, 8)) * 0.3}

  def loss(params, attention):
    q = jnp.einsum("bsc,chd->bshd", x, params["wq"])
    k = jnp.einsum("bsc,chd->bshd", x, params["wk"])
    v = jnp.einsum("bsc,chd->bshd", x, params["wv"])
    return jnp.mean((attention(q, k, v) - target) ** 2)

  def train(attention):
    return np.array(adam_losses(lambda p: loss(p, attention), params, steps=4))

  grads = jax.jit(jax.grad(loss), static_argnums=1)
  assert_grads_match(grads(params, attend), grads(params, prog.reference))
  assert_trains_alike(train(attend), train(prog.reference))


@pytest.mark.parametrize("causal", [False, True])
def test_head_parallel_backward_is_one_fused_call(causal):
  """Attention split over heads only: the backward is one kernel call per device, no dual passes."""
  from jax.sharding import PartitionSpec as P

  from jaxmercury.lowering.local_backward import local_reason
  prog = jm.programs.attention(2, 16, 8, 32, 32, 8, causal=causal)
  mesh = make_mesh("8")
  heads = P(None, None, "x", None)
  schedule = jm.library(prog, mesh)["ulysses"].with_layouts([heads] * 3, heads)
  assert local_reason(schedule) is None
  _check_grads(schedule)
  xs = prog.random_inputs(fresh_key())
  f = schedule.compile()
  text = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))).lower(*xs).as_text()
  for collective in ("all_to_all", "collective_permute", "all_gather", "reduce_scatter", "all_reduce"):
    assert collective not in text, collective


@pytest.mark.parametrize("axis_type,inside,causal", [(AxisType.Explicit, True, True), (AxisType.Auto, False, False)])
def test_the_head_parallel_strategy_moves_nothing_and_trains_in_one_backward_call(axis_type, inside, causal):
  """``head_parallel`` splits the kv heads over every level, at a length the mesh does not divide: no collective
  forward or backward for inputs in its layouts, the backward one call per device, the gradients right; where the
  kv heads do not divide over the devices it is not offered."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxmercury.lowering.local_backward import local_reason
  mesh = make_mesh("2x4", axis_type)
  both = ("node", "gpu")
  heads = P(None, None, both, None)
  assert "head_parallel" not in jm.library(jm.programs.attention(1, 16, 2, 36, 36, 8), mesh)
  # each program under one axis type, inside jax.set_mesh or not: pairwise
  prog = jm.programs.attention(1, 16, 8, 36, 36, 8, causal=True) if causal else jm.programs.attention(2, 8, 8, 36, 36, 8)
  with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
    schedule = jm.library(prog, mesh)["head_parallel"]
    assert [schedule.plan().user_spec(b) for b in ("q", "k", "v", "o")] == [heads] * 4
    assert local_reason(schedule) is None and "communication: none" in str(schedule)
    _check_grads(schedule)
    xs = [jax.device_put(x, NamedSharding(mesh, heads)) for x in prog.random_inputs(fresh_key())]
    f = schedule.compile()
    text = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))).lower(*xs).as_text()
    for collective in ("all_to_all", "collective_permute", "all_gather", "reduce_scatter", "all_reduce"):
      assert collective not in text, collective


@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag", "context_parallel", "tree"])
def test_any_schedule_on_one_device_has_the_fused_backward(strategy):
  """Rings, reductions and layouts over a level of one device move nothing: one backward call, no dual passes,
  the gradients right."""
  from jaxmercury.lowering.local_backward import local_reason
  one = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.attention(1, 4, 2, 64, 64, 8, causal=True)
  schedule = jm.library(prog, one)[strategy]
  assert local_reason(schedule) is None
  _check_grads(schedule)


def test_xla_fused_backward_only_where_its_scores_fit():
  """XLA's derivative holds the whole score matrix; past ``kernels.xla.SCORES_BYTES`` the dual programs recompute
  it."""
  from jaxmercury.kernels.xla import SCORES_BYTES as XLA_SCORES_BYTES
  from jaxmercury.lowering.local_backward import local_reason
  one = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  big = jm.programs.attention(1, 32, 8, 16384, 16384, 128, causal=True)  # 32 GiB of float32 scores
  assert XLA_SCORES_BYTES < 4 * 32 * 16384 * 16384
  assert "bytes of scores per device" in local_reason(jm.library(big, one)["ring"])


def test_communicating_schedules_keep_the_dual_backward():
  from jaxmercury.lowering.local_backward import local_reason
  prog = jm.programs.attention(1, 4, 4, 32, 32, 8, causal=True)
  lib = jm.library(prog, make_mesh("8"))
  assert local_reason(lib["ring"]) == "blocks travel or reduce across devices"
  assert local_reason(lib["context_parallel"]) == "buffers are resharded around the loop nest"
  from jaxmercury.kernels import registry
  with registry.interpret_mode():
    lib["ring"].patch("pallas_attention")
  assert local_reason(lib["ring"]) == "kernel 'pallas_attention' has no fused backward"


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_library_backwards_run_dq_and_dkv_in_one_nest(mesh_name):
  """Every communicating library schedule's dual programs walk the same loops: one joint nest."""
  from jaxmercury.lowering.joint_backward import joint_reason
  from jaxmercury.lowering.local_backward import local_reason
  from jaxmercury.schedules.dual import attention_duals
  prog = jm.programs.attention(**ATTENTION["gqa"], causal=True)
  for name, schedule in jm.library(prog, make_mesh(mesh_name)).items():
    if local_reason(schedule) is None:
      continue
    _, dq, dkv = attention_duals(schedule, joint=True)
    assert joint_reason(dq, dkv) is None, name


@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag"])
def test_a_ring_backward_computes_each_block_pair_once_and_moves_keys_once(strategy, monkeypatch):
  """The joint ring backward: one body call per ring step, where dq and dk-dv apart trace two; its key and value
  blocks travel one ring (with the dk-dv partials) instead of two."""
  from jaxmercury.kernels import xla
  from jaxmercury.programs import attention_backward as ab
  calls = {"dq": 0, "dkv": 0, "joint": 0}

  def counted(name, fn):
    def run(*args, **kwargs):
      calls[name] += 1
      return fn(*args, **kwargs)
    return run

  monkeypatch.setattr(ab, "dq_block", counted("dq", ab.dq_block))
  monkeypatch.setattr(ab, "dkv_block", counted("dkv", ab.dkv_block))
  monkeypatch.setattr(xla, "dq_dkv_block", counted("joint", xla.dq_dkv_block))
  from jaxmercury.lowering import differentiate
  prog = jm.programs.attention(1, 8, 2, 256, 256, 8, causal=True)
  schedule = jm.library(prog, make_mesh("8"))[strategy]
  xs = prog.random_inputs(fresh_key())

  def permutes():
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(schedule.compile()(*a)), argnums=(0, 1, 2)))
    return grad.lower(*xs).as_text().count("collective_permute")

  joint = permutes()
  steps = 8 * (4 if strategy == "ring_zigzag" else 1)  # ring steps, times the zigzag halves' block pairs
  assert calls == {"dq": 0, "dkv": 0, "joint": steps}, calls
  if strategy == "ring":  # forward: k, v over 7 steps; backward: k, v over 1 + 7 steps, the dk-dv partials over 7
    assert joint == 2 * 7 + 2 * 8 + 7
  monkeypatch.setattr(differentiate, "joint_backward", lambda *a, **k: None)
  apart = permutes()
  assert calls == {"dq": steps, "dkv": steps, "joint": steps}, calls
  # the dq program's own ring of keys and values (and, zigzag, its own reordering of the six inputs)
  assert apart - joint == 2 * 7 if strategy == "ring" else apart - joint > 2 * 7
  # its gradients: test_attention_library_gradients
