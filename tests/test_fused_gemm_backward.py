"""The fused GEMMs' backward (``lowering.fused_gemm_backward``) over 8 simulated CPU devices.

The Mosaic GPU kernels run only on Hopper GPUs (and, interpreted, on one CPU
device), so here XLA programs stand in for them with the same per-device
contract: an all-gather GEMM's stand-in brings the other devices' rows by a
ring of ``ppermute`` into receive slots laid out as the kernels' are, and
returns them through ``peer_gemm.gathered_rows``, as the kernels do. What is
checked is the backward built around them: the dual kernel chosen, the
gradients against the float32 reference and the ordinary lowering, and that
no operand is gathered twice.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, make_mesh, rel_err
from jax import lax

import jaxmercury as jm
from jaxmercury.analysis import placements
from jaxmercury.kernels import placements as kplacements
from jaxmercury.kernels import registry
from jaxmercury.kernels.gemm.peer import gathered_rows

AG, AG_WS, AG_JAX = "fused_allgather_matmul", "fused_allgather_matmul_ws", "jax_allgather_lhs_matmul"
RS, RS_WS = "fused_matmul_reducescatter", "fused_matmul_reducescatter_ws"


def _received(a, level):
  """The kernels' receive slots, by ``ppermute``: on device ``r``, slot ``s`` holds device ``(r + s + 1) % n``'s rows."""
  n = lax.axis_size(level)
  return jnp.stack([lax.ppermute(a, level, [(j, (j - s - 1) % n) for j in range(n)]) for s in range(n - 1)])


def _allgather_standin(p, params, interpret):
  def per_device(a, b, gathered=False):
    full = gathered_rows(a, _received(a, p.level), p.level)
    out = jnp.dot(full, b, preferred_element_type=jnp.float32).astype(p.c.dtype)
    return (out, full) if gathered else out
  return per_device


def _jax_standin(p, params, interpret):  # keeps no gathered rows, as JAX's kernel
  def per_device(a, b, gathered=False):
    full = lax.all_gather(a, p.level, axis=0, tiled=True)
    out = jnp.dot(full, b, preferred_element_type=jnp.float32).astype(p.c.dtype)
    return (out, None) if gathered else out
  return per_device


def _reducescatter_standin(p, params, interpret):
  def per_device(a, b):
    partial = jnp.dot(a, b, preferred_element_type=jnp.float32)
    return lax.psum_scatter(partial, p.level, scatter_dimension=0, tiled=True).astype(p.c.dtype)
  return per_device


STANDINS = {AG: _allgather_standin, AG_WS: _allgather_standin, AG_JAX: _jax_standin, RS: _reducescatter_standin,
            RS_WS: _reducescatter_standin}


@pytest.fixture
def standins(monkeypatch):
  """Every fused GEMM lowering runs its stand-in on any devices; ``standins(name)`` takes one off the devices."""
  def runs(p, mesh):
    return None

  for name, make in STANDINS.items():
    monkeypatch.setitem(registry._KERNELS, name, dataclasses.replace(
        registry._KERNELS[name], make=make, devices=runs, interpret=False))

  def off(name):
    monkeypatch.setitem(registry._KERNELS, name, dataclasses.replace(
        registry._KERNELS[name], devices=lambda p, mesh: "not on these devices"))
  return off


def _gradients(schedule):
  """``(gradients, ordinary gradients, the reference's, the gradient program's HLO)`` on fresh inputs."""
  prog = schedule.program
  a, b = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32).astype(jnp.bfloat16)
  f = schedule.compile()
  out, vjp = jax.vjp(f, a, b)
  ref_out, ref_vjp = jax.vjp(jnp.dot, a.astype(jnp.float32), b.astype(jnp.float32))
  assert rel_err(out.astype(jnp.float32), ref_out) < 1e-2
  _, plain_vjp = jax.vjp(schedule.without('lower_with').compile(), a, b)
  grad = jax.jit(lambda a, b, c: jax.vjp(f, a, b)[1](c)).lower(a, b, cot).compile().as_text()
  return vjp(cot), plain_vjp(cot), ref_vjp(cot.astype(jnp.float32)), grad


def _check(schedule):
  grads, plain, ref, hlo = _gradients(schedule)
  for name, g, p, w in zip("AB", grads, plain, ref):
    assert g.dtype == jnp.bfloat16 and g.shape == w.shape, name
    assert rel_err(g.astype(jnp.float32), w) < 2e-2, f"d{name}"
    assert rel_err(g.astype(jnp.float32), p.astype(jnp.float32)) < 1e-2, f"d{name} against the ordinary backward"
  return hlo


def _gather_ops(hlo: str) -> int:
  return hlo.count("all-gather-start(") + hlo.count("all-gather(")


def _scatter_ops(hlo: str) -> int:
  return hlo.count("reduce-scatter(") + hlo.count("reduce-scatter-start(")


def test_gathered_rows_are_the_all_gather():
  """The receive slots, rolled by the device's index, are ``all_gather(a)``: every row block where it belongs."""
  mesh = make_mesh("8")
  a = jax.random.normal(fresh_key(), (8 * 24, 40), jnp.float32)
  spec = jax.sharding.PartitionSpec("x", None)

  def both(a):
    return gathered_rows(a, _received(a, "x"), "x")[None], lax.all_gather(a, "x", axis=0, tiled=True)[None]

  got, want = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))(a)
  assert (got == want).all() and (got[3] == a).all()


@pytest.mark.parametrize("shape", [(512, 256, 128), (200, 136, 72)], ids=["tiled", "ragged"])
@pytest.mark.parametrize("strategy,lowering", [("async_tp", AG), ("allgather_matmul", AG_WS)])
def test_an_allgather_gemms_backward_reduce_scatters_da_and_gathers_nothing(standins, strategy, lowering, shape):
  """dA by the dual reduce-scatter kernel, dB locally on the rows the forward's ring gathered: the gradient
  program all-gathers nothing (the ordinary backward gathered A again)."""
  prog = jm.programs.matmul(*shape, dtype=jnp.bfloat16)
  plain = jm.library(prog, make_mesh("8"))[strategy]
  s = plain.copy().lower_with(lowering)
  assert placements.dual_kernel(s).name == {AG: RS, AG_WS: RS_WS}[lowering]
  hlo = _check(s)
  assert _gather_ops(hlo) == 0 and _scatter_ops(hlo) == 1
  assert "gradients: the dual fused GEMM, fed by the forward's gathered rows" in str(s)


@pytest.mark.parametrize("shape", [(512, 256, 128), (200, 136, 72)], ids=["tiled", "ragged"])
@pytest.mark.parametrize("strategy,lowering", [("matmul_reducescatter", RS), ("async_tp_reducescatter", RS_WS)])
def test_a_reducescatter_gemms_backward_gathers_dc_once(standins, strategy, lowering, shape):
  """dA by the dual all-gather kernel, whose ring gathers dC; dB locally on those rows: the gradient program's
  only collectives are that ring's (the forward's output is not needed, so its reduce-scatter is gone too)."""
  prog = jm.programs.matmul(*shape, dtype=jnp.bfloat16)
  s = jm.library(prog, make_mesh("8"))[strategy].copy().lower_with(lowering)
  assert placements.dual_kernel(s).name == {RS: AG, RS_WS: AG_WS}[lowering]
  hlo = _check(s)
  assert _gather_ops(hlo) == 0 and _scatter_ops(hlo) == 0 and "collective-permute" in hlo


def test_jaxs_kernel_keeps_no_rows_so_its_backward_gathers_a(standins):
  prog = jm.programs.matmul(512, 256, 128, dtype=jnp.bfloat16)
  s = jm.library(prog, make_mesh("8"))["async_tp"].copy().lower_with(AG_JAX)
  assert placements.dual_kernel(s).name == RS_WS
  hlo = _check(s)
  assert _gather_ops(hlo) == 1 and _scatter_ops(hlo) == 1  # the backward's gather of A (the forward's is unused)


@pytest.mark.parametrize("strategy,lowering", [("async_tp", AG), ("matmul_reducescatter", RS)])
def test_without_the_dual_kernel_xlas_collectives_stand_in(standins, strategy, lowering):
  prog = jm.programs.matmul(512, 256, 128, dtype=jnp.bfloat16)
  s = jm.library(prog, make_mesh("8"))[strategy].copy().lower_with(lowering)
  standins(registry.fused(lowering).backward.dual)
  assert placements.dual_kernel(s) is None
  hlo = _check(s)
  if lowering == AG:
    assert _gather_ops(hlo) == 0 and _scatter_ops(hlo) == 1  # psum_scatter of dA
  else:
    assert _gather_ops(hlo) == 1 and _scatter_ops(hlo) == 0  # all_gather of dC


def test_every_fused_gemm_kernel_has_a_dual_of_the_other_kind():
  gemms = [k for k in registry.fused_kernels() if k.placement in (kplacements.ALLGATHER, kplacements.REDUCESCATTER)]
  assert len(gemms) == 6
  for k in gemms:
    assert isinstance(k.backward, registry.DualGemm)
    assert k.placement != registry.fused(k.backward.dual).placement


@pytest.mark.parametrize("strategy,lowering", [("async_tp", AG), ("matmul_reducescatter", RS)])
def test_explicit_mesh_axes(standins, strategy, lowering):
  """On a mesh of explicit axes the gradients come back sharded as the ordinary lowering's do."""
  from jax.sharding import AxisType
  prog = jm.programs.matmul(512, 256, 128, dtype=jnp.bfloat16)
  plain = jm.library(prog, make_mesh("8", AxisType.Explicit))[strategy]
  s = plain.copy().lower_with(lowering)
  _check(s)
  a, b = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32).astype(jnp.bfloat16)
  grads = jax.vjp(s.compile(), a, b)[1](cot)
  plain_grads = jax.vjp(plain.compile(), a, b)[1](cot)
  assert [jax.typeof(g).sharding.spec for g in grads] == [jax.typeof(g).sharding.spec for g in plain_grads]
