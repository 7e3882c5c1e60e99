"""The fused ring-attention lowering of causal programs: natural and zigzag order (``ring``, ``ring_zigzag``).

On a one-device CPU mesh the kernel runs in Mosaic GPU interpret mode and is
checked against the program's reference and the ordinary lowering's outputs
and gradients; on the simulated 8-device mesh ``why_not`` names what it
refuses; on an abstract 8 x H100 mesh the GPU path lowers. Rings of several
GPUs run in tests/gpu/test_fused_ring_attention.py.
"""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, h100_mesh, lower_for_gpus, make_mesh, mosaic_kernels, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.analysis import placements
from jaxmercury.kernels import placements as kplacements
from jaxmercury.kernels import registry
from jaxmercury.lowering import fused as lowering_fused
from jaxmercury.schedules.library import split
from jaxmercury.tuner import autotuner as tune_module

RING = "fused_ring_attention"


def _one_device_mesh():
  return jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


def _causal(s=256, batch=1, d=64, dtype=jnp.bfloat16):
  return jm.programs.attention(batch, 4, 2, s, s, d, causal=True, dtype=dtype)


def _zigzag_ring(prog, mesh, chunks: int, axes=("i", "j")):
  """A ring over every level with ``axes`` stored in zigzag order of ``chunks`` chunks (``ring_zigzag``'s
  layout when ``chunks`` is twice the device count)."""
  s = jm.Schedule(prog, mesh)
  for axis in axes:
    s.zigzag(axis, chunks)
  levels = list(mesh.axis_names)
  for p, j in zip(split(s, "i", levels), split(s, "j", levels, parallel=False)):
    s.shift(j, p)
  return s


def _schedules(prog, mesh):
  lib = jm.library(prog, mesh)
  return {"ring": lib["ring"], "ring_zigzag": lib["ring_zigzag"],
          # one device, 4 chunks: true chunks 0, 3, 1, 2, so the order is not the natural one
          "zigzag4": _zigzag_ring(prog, mesh, 4)}


# ------------------------------------------------------------------ numerics (interpret mode, one device)
@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag", "zigzag4"])
def test_causal_ring_runs_interpreted_with_the_ordinary_gradients(strategy):
  mesh = _one_device_mesh()
  prog = _causal(256)
  plain = _schedules(prog, mesh)[strategy]
  assert placements.why_not(RING, plain) is None
  s = plain.copy().lower_with(RING)
  assert "lowered with fused_ring_attention (Mosaic GPU interpret mode)" in str(s)
  q, k, v = prog.random_inputs(fresh_key())
  f = s.compile()
  out = f(q, k, v)
  assert "wgmma" in str(jax.make_jaxpr(f)(q, k, v))  # the Mosaic GPU kernel ran, not the nest
  want = prog.reference(q, k, v)
  assert out.shape == want.shape and out.dtype == jnp.bfloat16
  assert rel_err(out.astype(jnp.float32), want.astype(jnp.float32)) < 2e-2
  ordinary = plain.compile()
  assert rel_err(out.astype(jnp.float32), ordinary(q, k, v).astype(jnp.float32)) < 2e-2
  cot = jax.random.normal(fresh_key(), out.shape, jnp.float32).astype(jnp.bfloat16)
  _, vjp = jax.vjp(f, q, k, v)
  _, vjp_plain = jax.vjp(ordinary, q, k, v)
  for got, ref in zip(vjp(cot), vjp_plain(cot)):  # the same backward, compiled apart: bf16 roundings may differ
    assert got.dtype == ref.dtype == jnp.bfloat16
    assert rel_err(got.astype(jnp.float32), ref.astype(jnp.float32)) < 1e-2


def test_the_placement_records_the_order():
  mesh = _one_device_mesh()
  prog = _causal(256)
  placed = {name: placements.place(RING, s) for name, s in _schedules(prog, mesh).items()}
  assert {name: (p.causal, p.order, p.chunks) for name, p in placed.items()} == {
      "ring": (True, "natural", None), "ring_zigzag": (True, "zigzag", 2), "zigzag4": (True, "zigzag", 4)}
  non_causal = jm.programs.attention(1, 4, 2, 256, 256, 64, dtype=jnp.bfloat16)
  p = placements.place(RING, jm.library(non_causal, mesh)["ring"])
  assert (p.causal, p.order, p.chunks) == (False, "natural", None)


def test_the_tuner_offers_the_causal_fused_rings_in_interpret_mode():
  with registry.interpret_mode():
    names = [c.name for c in tune_module.default_candidates(_causal(256), _one_device_mesh(), space=2)]
  assert {f"ring {{{RING}}}", f"ring_zigzag {{{RING}}}"} <= set(names)


# ------------------------------------------------------------------ preconditions
def test_why_not_takes_causal_rings_on_the_simulated_mesh():
  """8 CPU devices: no Hopper GPUs, but nothing about the causal mask or the zigzag order is refused."""
  mesh = make_mesh("8")
  lib = jm.library(_causal(2048), mesh)  # 256 positions per device, zigzag chunks of 128
  for strategy in ("ring", "ring_zigzag"):
    reason = placements.why_not(RING, lib[strategy])
    assert "Hopper" in reason and "causal" not in reason and "zigzag" not in reason, reason
  assert kplacements.KIND_NAMES["ring_attention"] == "ring attention"


@pytest.mark.parametrize("build,message", [
    (lambda prog, mesh: _zigzag_ring(prog, mesh, 16, axes=("i",)),
     "axis 'i' is stored in zigzag order in 16 chunks but axis 'j' in natural order; the fused ring-attention "
     "kernel takes queries and keys in one order"),
    (lambda prog, mesh: _zigzag_ring(prog, mesh, 16, axes=("j",)),
     "axis 'i' is stored in natural order but axis 'j' in zigzag order in 16 chunks"),
    (lambda prog, mesh: _zigzag_ring(prog, mesh, 4),
     "axis 'i' is stored in zigzag order in 4 chunks, not a multiple of the 8 devices of level 'x'; the fused "
     "ring-attention kernel takes whole chunks per device"),
    (lambda prog, mesh: _zigzag_ring(prog, mesh, 64),
     "block_q=64 does not divide each zigzag chunk's positions of 'i' (32)"),
    (lambda prog, mesh: _zigzag_ring(prog, mesh, 16, axes=("b", "i", "j")),
     "axis 'b' is stored in zigzag order; the fused ring-attention kernel takes zigzag order on the sequence axes "
     "'i' and 'j' only"),
], ids=["queries-only", "keys-only", "chunks-per-device", "short-chunks", "batch"])
def test_why_not_names_the_zigzag_axis_it_refuses(build, message):
  prog = _causal(2048, batch=16)
  s = build(prog, make_mesh("8"))
  assert placements.why_not(RING, s).startswith(message), placements.why_not(RING, s)
  with pytest.raises(jm.PreconditionError, match="lower_with\\('fused_ring_attention'\\): " + message[:20]):
    s.copy().lower_with(RING)


def test_the_gemm_lowerings_still_refuse_zigzag_axes():
  mesh = _one_device_mesh()
  s = jm.Schedule(jm.programs.matmul(128, 128, 64, dtype=jnp.bfloat16), mesh).zigzag("m", 2)
  for name in ("fused_allgather_matmul", "fused_matmul_reducescatter"):
    assert placements.why_not(name, s) == "axis 'm' is stored in zigzag order; a fused lowering takes the natural order"


# ------------------------------------------------------------------ the GPU path, lowered without GPUs
@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag"])
def test_the_causal_rings_lower_for_eight_h100s(strategy):
  """The per-device function as the GPU runs it (no interpret mode) lowers to one Mosaic GPU kernel under the
  schedule's shard_map for an abstract 8 x H100 mesh, zigzag reordering around it included."""
  from jaxmercury.lowering.lower import lower
  mesh = h100_mesh(8)
  prog = jm.programs.attention(1, 8, 2, 8192, 8192, 128, causal=True, dtype=jnp.bfloat16)
  s = jm.library(prog, mesh)[strategy].copy().lower_with(RING)
  p = placements.place(RING, s)
  assert (p.causal, p.order, p.chunks) == ((True, "natural", None) if strategy == "ring" else (True, "zigzag", 16))
  plan = s.plan()
  specs = [jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=NamedSharding(mesh, plan.user_spec(b.name) or P()))
           for b in prog.reads]
  text = lower_for_gpus(lower(s, per_device=lowering_fused.per_device(s)), *specs, mesh=mesh)
  assert mosaic_kernels(text) == 1
