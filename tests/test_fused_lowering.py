"""Fused lowerings (``Schedule.lower_with``) on CPU: preconditions, trace, printer, tuner, cost model.

On the simulated 8-device mesh no fused lowering applies (no Hopper GPUs);
on a one-device CPU mesh our kernel runs in Mosaic GPU interpret mode, which
checks the numerics and the backward. Rings of several GPUs run in
tests/gpu/test_fused_lowering.py.
"""

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, h100_mesh, lower_for_gpus, make_mesh, mosaic_kernels, rel_err
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.analysis import memory, placements
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import registry
from jaxmercury.kernels.gemm import allgather_jax as jax_allgather_matmul
from jaxmercury.lowering import fused as lowering_fused
from jaxmercury.lowering import lower
from jaxmercury.schedules import dual
from jaxmercury.tuner import autotuner as tune_module
from jaxmercury.tuner import cost
from jaxmercury.tuner.candidates import program_key

OURS, JAXS = "fused_allgather_matmul", "jax_allgather_lhs_matmul"
OURS_RS, WS_RS = "fused_matmul_reducescatter", "fused_matmul_reducescatter_ws"
SMALL = dict(tile_m=64, max_concurrent_steps=2)  # fewer interpreted steps


def _one_device_mesh():
  return jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


def _bf16(m=256, n=256, k=128):
  return jm.programs.matmul(m, n, k, dtype=jnp.bfloat16)


# ------------------------------------------------------------------ preconditions
def test_why_not_names_the_problem_on_the_simulated_mesh():
  mesh = make_mesh("8")
  lib = jm.library(_bf16(), mesh)
  for strategy in ("async_tp", "allgather_matmul"):
    ours = placements.why_not(OURS, lib[strategy])
    assert "Hopper" in ours and "cpu" in ours and "interpret mode" in ours and "level 'x'" in ours, ours
    assert "Hopper" in placements.why_not(JAXS, lib[strategy])
  for strategy in ("matmul_reducescatter", "async_tp_reducescatter"):  # A split along k: reduce-scatter kernels
    for name in (OURS, JAXS):
      assert placements.why_not(name, lib[strategy]) == (
          f"{name} computes an all-gather GEMM; this schedule stores A[m, k@x], B[k@x, n], C[m@x, n]: "
          "a GEMM + reduce-scatter")
    assert "Hopper" in placements.why_not(OURS_RS, lib[strategy]) and "Hopper" in placements.why_not(WS_RS, lib[strategy])
  assert placements.why_not(OURS_RS, lib["async_tp"]).startswith("fused_matmul_reducescatter computes a GEMM + "
                                                            "reduce-scatter; this schedule stores A[m@x, k]")
  replicated = lib["allgather_matmul"].with_layouts([P(), P()], P())
  assert placements.why_not(OURS, replicated).startswith("buffer A is stored A[m, k]: neither its rows (m) nor its "
                                                    "columns (k) are split")
  f32 = jm.library(jm.programs.matmul(256, 256, 128), mesh)["async_tp"]
  assert "float32" in placements.why_not(OURS, f32) and "bf16 or fp16" in placements.why_not(OURS, f32)
  two_levels = jm.library(_bf16(), make_mesh("2x4"))["async_tp"]
  assert "split over 2 levels" in placements.why_not(OURS, two_levels)
  attention = jm.library(jm.programs.attention(1, 4, 2, 64, 64, 16, dtype=jnp.bfloat16), mesh)["ring"]
  assert "pattern 'matmul'" in placements.why_not(OURS, attention)
  assert placements.applicable(lib["async_tp"]) == []


def test_why_not_reads_the_callers_layouts():
  mesh = _one_device_mesh()
  prog = _bf16(128, 128, 64)
  s = jm.library(prog, mesh)["async_tp"]
  assert placements.why_not(OURS, s) is None
  # the same trace for a caller whose C is split by rows: C's layout is not the kernel's
  laid = s.with_layouts(None, P("x", None))
  assert placements.why_not(OURS, laid).startswith("buffer C is stored C[m@x, n], not C[m, n@x]")
  assert "device" in placements.why_not(JAXS, s)  # one of the process's 8 devices: JAX's kernel spans them all


def test_lower_with_raises_before_anything_runs():
  mesh = make_mesh("8")
  s = jm.library(_bf16(), mesh)["async_tp"]
  before = s.to_json()
  with pytest.raises(jm.PreconditionError, match=r"lower_with\('fused_allgather_matmul'\): .*Hopper"):
    s.lower_with(OURS)
  with pytest.raises(jm.UnknownNameError, match="known: .*'fused_allgather_matmul', 'fused_allgather_matmul_comm', "
                                                 "'fused_allgather_matmul_ws', 'fused_matmul_reducescatter', "
                                                 "'fused_matmul_reducescatter_ws', 'fused_ring_attention', "
                                                 "'fused_ring_attention_ws', 'jax_allgather_lhs_matmul'"):
    s.lower_with("fused_gemm")
  assert s.to_json() == before and s.lowering is None and s.lowering_config is None

  one = jm.library(_bf16(128, 128, 64), _one_device_mesh())["async_tp"]
  with pytest.raises(jm.UnknownNameError, match="no parameter 'tile_q'; parameters: .*'tile_m'"):
    one.lower_with(OURS, tile_q=64)
  with pytest.raises(jm.PreconditionError, match="tile_m=96 must be a multiple of 64"):
    one.lower_with(OURS, tile_m=96)
  assert one.lowering is None and all(step["primitive"] != "lower_with" for step in one.trace)

  # A primitive after lower_with that breaks its preconditions: compile() refuses before tracing.
  later = jm.library(_bf16(128, 128, 64), _one_device_mesh())["allgather_matmul"].lower_with(OURS)
  later.replicate("A", "n0")
  with pytest.raises(jm.PreconditionError, match="buffer A is stored A\\[m, k\\]"):
    later.compile()


def test_trace_round_trip_and_printer_keep_the_lowering():
  mesh = _one_device_mesh()
  prog = _bf16(128, 128, 64)
  s = jm.library(prog, mesh)["async_tp"].lower_with(OURS, **SMALL)
  assert s.trace[-1] == {"primitive": "lower_with", "args": [OURS], "kwargs": SMALL}
  again = jm.Schedule.from_json(prog, mesh, s.to_json())
  assert (again.lowering, configs.changed(again.lowering_config)) == (OURS, SMALL) and again.to_json() == s.to_json()
  jm.validate.validate(prog, mesh, schedule=again)
  text = str(again)
  assert "lowered with fused_allgather_matmul(tile_m=64, max_concurrent_steps=2) (Mosaic GPU interpret mode): " \
         "the whole nest runs as one fused kernel per device" in text
  assert "lowered with" not in str(jm.library(prog, mesh)["async_tp"])
  with pytest.raises(AttributeError):  # a schedule changes only through its primitives
    s.copy().lowering_config = None
  assert configs.changed(s.lowering_config) == SMALL


# ------------------------------------------------------------------ numerics (interpret mode, one device)
@pytest.mark.parametrize("strategy,lowering,shape", [
    ("async_tp", OURS, (128, 128, 64)), ("allgather_matmul", OURS, (72, 136, 40)),
    ("matmul_reducescatter", OURS_RS, (128, 128, 64)), ("async_tp_reducescatter", OURS_RS, (72, 136, 40))],
    ids=["async_tp", "allgather-ragged", "reducescatter", "reducescatter-ragged"])
def test_interpreted_kernel_and_its_backward_match_the_reference(strategy, lowering, shape):
  mesh = _one_device_mesh()
  prog = _bf16(*shape)
  plain = jm.library(prog, mesh)[strategy]
  s = plain.copy().lower_with(lowering, **SMALL)
  a, b = prog.random_inputs(fresh_key())
  f = s.compile()
  y = f(a, b)
  assert y.shape == prog.writes.shape and y.dtype == jnp.bfloat16
  ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
  assert rel_err(y.astype(jnp.float32), ref) < 2e-2
  assert "wgmma" in str(jax.make_jaxpr(f)(a, b))  # the Mosaic GPU kernel ran, not the nest

  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32).astype(jnp.bfloat16)
  _, vjp = jax.vjp(f, a, b)  # the dual fused GEMM's backward (fused_gemm_backward), interpreted too
  _, vjp_plain = jax.vjp(plain.compile(), a, b)
  _, vjp_ref = jax.vjp(jnp.dot, a.astype(jnp.float32), b.astype(jnp.float32))
  for got, plain_grad, want in zip(vjp(cot), vjp_plain(cot), vjp_ref(cot.astype(jnp.float32))):
    assert got.dtype == plain_grad.dtype == jnp.bfloat16
    assert rel_err(got.astype(jnp.float32), want) < 1e-2
    assert rel_err(got.astype(jnp.float32), plain_grad.astype(jnp.float32)) < 1e-2  # bf16 roundings apart


def test_on_one_device_the_twin_fused_gemms_compute_what_the_all_gather_kernel_does():
  """``FusedKernel.one_device``: on one device the reduce-scatter kernel and the all-gather kernel with
  communication CTAs run the all-gather kernel's program at the same tiles (``placements.runs_as``, the tuner's
  ``program_key``): interpreted, the same output and gradients, bit for bit. Over eight devices each is its own."""
  mesh, prog = _one_device_mesh(), _bf16(128, 128, 64)
  lib = jm.library(prog, mesh)
  ag = lib["allgather_matmul"].copy().lower_with(OURS, **SMALL)
  twins = [lib["matmul_reducescatter"].copy().lower_with(OURS_RS, **SMALL),
           lib["allgather_matmul"].copy().lower_with("fused_allgather_matmul_comm", **SMALL)]
  a, b = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32).astype(jnp.bfloat16)

  def run(s):
    out, vjp = jax.vjp(s.compile(), a, b)
    return (out, *vjp(cot))

  want = run(ag)
  for s in twins:
    assert placements.runs_as(s) == (OURS, ag.lowering_config) and program_key(s) == program_key(ag)
    for got, w in zip(run(s), want):
      assert bool(jnp.all(got == w)), s.lowering
  chunked = lib["allgather_matmul"].copy().lower_with("fused_allgather_matmul_comm", chunk_tiles=2, **SMALL)
  assert placements.runs_as(chunked)[0] == "fused_allgather_matmul_comm"  # rows padded to chunks: its own
  eight = jm.library(jm.programs.matmul(2048, 2048, 1024, dtype=jnp.bfloat16), h100_mesh(8))
  rs = eight["matmul_reducescatter"].copy().lower_with(OURS_RS)
  assert placements.runs_as(rs) == (OURS_RS, rs.lowering_config)


# ------------------------------------------------------------------ tuner and cost model
def test_the_tuner_offers_no_fused_candidates_on_the_cpu_mesh():
  for mesh in (make_mesh("8"), make_mesh("2x4"), _one_device_mesh()):
    names = [c.name for c in tune_module.default_candidates(_bf16(), mesh, space=4)]
    assert not any("{" in n for n in names), names
  with registry.interpret_mode():  # interpret mode is offered only when asked for, as for kernels
    names = [c.name for c in tune_module.default_candidates(_bf16(128, 128, 64), _one_device_mesh(), space=4)]
  assert {f"async_tp {{{OURS}}}", f"allgather_matmul {{{OURS}}}"} <= set(names)
  assert not any(JAXS in n for n in names)


def test_cost_model_overlaps_the_ring_with_the_gemm():
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))  # plans: devices are not checked
  prog = _bf16(8192, 8192, 8192)
  machine = cost.Machine("h200-ish", 700e12, {"*": 150e9}, 20e-6,
                         kernel_flops_per_s={"xla": 600e12, "mosaic_matmul": 500e12, "jax_mosaic_matmul": 650e12})
  lib = jm.library(prog, mesh)
  for name, rate in ((OURS, 500e12), (JAXS, 650e12)):
    s = lib["async_tp"].copy().lower_with(name)
    gemm = 2 * 8192 * 8192 * 1024 / rate
    ring = 7 * 1024 * 8192 * 2 / 150e9
    assert cost.predict(s, machine) == pytest.approx(max(gemm, ring) + 20e-6)
    fast = machine.with_links(x=1e13)
    assert cost.predict(s, fast) == pytest.approx(gemm + 20e-6)
    assert memory.memory_per_device(s) == (1024 * 8192 * 8 + 8192 * 1024 + 8192 * 1024) * 2
  rs = lib["async_tp_reducescatter"].copy().lower_with(WS_RS)
  gemm = 2 * 8 * 1024 * 1024 * 8192 / 650e12  # eight [1024, 1024] @ [1024, 8192] steps
  ring = 7 * 1024 * 8192 * 4 / 150e9  # float32 partial sums of seven row blocks
  assert cost.predict(rs, machine) == pytest.approx(max(gemm, ring) + 20e-6)
  assert memory.memory_per_device(rs) == (8192 * 1024 + 1024 * 8192 + 1024 * 8192) * 2 + 8 * 1024 * 8192 * 4
  # dedicated communication CTAs leave the GEMM the other SMs (an H100's 132 where the mesh names none)
  comm = lib["allgather_matmul"].copy().lower_with("fused_allgather_matmul_comm", comm_ctas=12)
  gemm = 2 * 8192 * 8192 * 1024 / 500e12
  assert cost.predict(comm, fast) == pytest.approx(gemm * 132 / 120 + 20e-6)
  # a rate calibration measured for the lowering on the mesh, ring included, prices it instead (and the SM split)
  measured = dataclasses.replace(machine, fused_flops_per_s={"fused_allgather_matmul_comm": 300e12})
  assert cost.predict(comm, measured.with_links(x=1e13)) == pytest.approx(2 * 8192 * 8192 * 1024 / 300e12 + 20e-6)
  cands = {c.name: c for c in tune_module.predict_candidates(prog, mesh, machine, space=2)}
  assert {f"matmul_reducescatter {{{OURS_RS}}}", f"async_tp_reducescatter {{{WS_RS}}}"} <= set(cands)
  assert {f"async_tp {{{OURS}}}", f"allgather_matmul {{{JAXS}}}"} <= set(cands)
  assert cands[f"async_tp {{{OURS}}}"].predicted_ms < cands["async_tp"].predicted_ms
  assert all(math.isfinite(c.predicted_ms) for c in cands.values())


# ------------------------------------------------------------------ ring attention
RING, WS_RING = "fused_ring_attention", "fused_ring_attention_ws"


def _attention(s=256, causal=False, d=64, dtype=jnp.bfloat16, heads=(4, 2)):
  return jm.programs.attention(1, *heads, s, s, d, causal=causal, dtype=dtype)


SMALL_HEADS = (2, 1)  # GQA, the fewest heads: what the interpreted kernels run on


def test_ring_attention_why_not_names_the_problem():
  mesh = make_mesh("8")
  lib = jm.library(_attention(1024), mesh)
  for strategy in ("ring", "context_parallel"):  # both store q, k, v, o split along the sequence
    assert "Hopper" in placements.why_not(RING, lib[strategy])
  assert placements.why_not(RING, lib["tree"]).startswith("buffer q is stored q[b, i, hk, g, d]: its sequence is "
                                                    "split over 0 levels")
  causal = jm.library(_attention(1024, causal=True), mesh)["ring"]
  assert "Hopper" in placements.why_not(RING, causal)  # causal rings apply too (tests/test_fused_causal_attention.py)
  f32 = jm.library(_attention(1024, dtype=jnp.float32), mesh)["ring"]
  assert "bf16 or fp16" in placements.why_not(RING, f32)
  short = jm.library(_attention(256), mesh)["ring"]  # 32 positions per device: not a multiple of 64
  assert "block_q=64 does not divide each device's positions of 'i' (32)" in placements.why_not(RING, short)
  odd_d = jm.library(_attention(1024, d=96), mesh)["ring"]
  assert "head dimension 'd' = 96" in placements.why_not(RING, odd_d)
  gemm = jm.library(_bf16(), mesh)["async_tp"]
  assert "pattern 'attention'" in placements.why_not(RING, gemm)
  assert placements.why_not(OURS, lib["ring"]).startswith("the fused kernels compute GEMMs")


def test_ring_attention_lowering_runs_interpreted_with_the_ordinary_gradients():
  mesh = _one_device_mesh()
  prog = _attention(128, heads=SMALL_HEADS)
  plain = jm.library(prog, mesh)["ring"]
  s = plain.copy().lower_with(RING, block_kv=128, ctas_per_sm=1)
  assert "lowered with fused_ring_attention(block_kv=128, ctas_per_sm=1) (Mosaic GPU interpret mode)" in str(s)
  with pytest.raises(jm.PreconditionError, match=r"ctas_per_sm=2: 2 CTAs of .* \(head dim 64\) exceed one SM's"):
    plain.copy().lower_with(RING, block_kv=192, max_concurrent_steps=3)
  q, k, v = prog.random_inputs(fresh_key())
  f = s.compile()
  out = f(q, k, v)
  want = prog.reference(q, k, v)
  assert out.shape == want.shape and out.dtype == jnp.bfloat16
  assert rel_err(out.astype(jnp.float32), want.astype(jnp.float32)) < 2e-2
  cot = jax.random.normal(fresh_key(), out.shape, jnp.float32).astype(jnp.bfloat16)
  _, vjp = jax.vjp(f, q, k, v)
  _, vjp_plain = jax.vjp(plain.compile(), q, k, v)
  for got, ref in zip(vjp(cot), vjp_plain(cot)):  # the same backward, compiled apart: bf16 roundings may differ
    assert got.dtype == ref.dtype == jnp.bfloat16
    assert rel_err(got.astype(jnp.float32), ref.astype(jnp.float32)) < 1e-2
  with registry.interpret_mode():
    names = [c.name for c in tune_module.default_candidates(prog, mesh, space=2)]
  assert f"ring {{{RING}}}" in names


def test_a_fused_gemms_backward_is_the_dual_fused_gemm_and_one_local_gemm():
  """The cost model prices a fused GEMM's backward as ``fused_gemm_backward`` runs it: the dual kernel (the other
  placement's) passing its ring's blocks under its GEMMs, then one local GEMM on the gathered operand; nothing
  of the forward runs again, except JAX's all-gather kernel's A, which it does not keep."""
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  machine = cost.Machine("h200-ish", 700e12, {"*": 150e9}, 20e-6, call_overhead_s=0.0)
  lib = jm.library(_bf16(8192, 8192, 8192), mesh)
  ag, rs = lib["async_tp"].copy().lower_with(OURS), lib["matmul_reducescatter"].copy().lower_with(OURS_RS)
  jaxs = lib["async_tp"].copy().lower_with(JAXS)
  block = 8192 // 8 * 8192  # one device's row block of dA (all-gather) or of dC (reduce-scatter)
  links_only = dataclasses.replace(machine, flops_per_s=1e30)
  assert cost.backward_seconds(ag, links_only) == pytest.approx(7 * block * 4 / 150e9 + 20e-6)  # float32 partials
  assert cost.backward_seconds(rs, links_only) == pytest.approx(7 * block * 2 / 150e9 + 20e-6)  # dC in bf16
  assert cost.backward_seconds(jaxs, links_only) == pytest.approx(7 * block * (4 + 2) / 150e9 + 2 * 20e-6)
  compute_only = dataclasses.replace(machine.with_links(x=1e30), latency_s=0.0)
  for s in (ag, rs):
    assert cost.backward_seconds(s, compute_only) == pytest.approx(
        2 * cost.compute_seconds(s.without('lower_with'), compute_only))
  assert "gradients: the dual fused GEMM, fed by the forward's gathered rows" in str(ag)


def test_a_fused_ring_attentions_backward_is_the_dual_of_its_cudnn_schedule_without_a_second_forward():
  """A fused ring attention keeps its kernel's output and log-sum-exp; its backward is the dual programs of the
  same ring patched with cuDNN (on GPUs), priced as that schedule's backward alone, with no forward again."""
  from jaxmercury.lowering.fused_attention import backward_schedule
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  machine = cost.Machine("h200-ish", 700e12, {"*": 150e9}, 20e-6, call_overhead_s=0.0)
  prog = jm.programs.attention(1, 32, 8, 32768, 32768, 128, causal=True, dtype=jnp.bfloat16)
  for strategy in ("ring", "ring_zigzag"):
    ring = jm.library(prog, mesh)[strategy]
    for name in (RING, "fused_ring_attention_ws"):
      s = ring.copy().lower_with(name)
      plain = s.without('lower_with')
      assert plain.lowering is None and plain.kernel is None and str(plain) == str(ring)
      backward = backward_schedule(s)
      assert backward.kernel == "cudnn_attention" and backward.lowering is None
      assert backward.plan().storage == ring.plan().storage and backward.zigzags == ring.zigzags
      assert cost.backward_seconds(s, machine) == pytest.approx(cost.backward_seconds(backward, machine))
      assert cost.backward_seconds(s, machine) < cost.predict(plain, machine) + cost.backward_seconds(plain, machine)
      assert "gradients: the dual programs, from the kernel's output and log-sum-exp" in str(s)
  cpu = _one_device_mesh()  # no cuDNN there: the dual programs run XLA's body
  s = jm.library(_attention(128), cpu)["ring"].copy().lower_with(RING)
  assert backward_schedule(s).kernel is None


def test_ring_attention_cost_and_memory():
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  prog = jm.programs.attention(1, 32, 8, 32768, 32768, 128, dtype=jnp.bfloat16)
  s = jm.library(prog, mesh)["ring"].copy().lower_with(RING)
  machine = cost.Machine("h200-ish", 700e12, {"*": 150e9}, 20e-6, kernel_flops_per_s={RING: 400e12})
  attention = 4 * 32 * 4096 * 32768 * 128 / 400e12
  ring = 7 * 2 * 4096 * 8 * 128 * 2 / 150e9
  assert cost.predict(s, machine) == pytest.approx(max(attention, ring) + 20e-6)
  measured = dataclasses.replace(machine, fused_flops_per_s={RING: 200e12})  # calibrate.fused_rates' figure wins
  assert cost.predict(s, measured) == pytest.approx(max(2 * attention, ring) + 20e-6)
  assert memory.memory_per_device(s) == (2 * 4096 * 32 * 128 + 2 * 8 * 4096 * 8 * 128) * 2 + 4 * 32 * 4096
  fast = machine.with_links(x=1e15)
  causal = jm.programs.attention(1, 32, 8, 32768, 32768, 128, causal=True, dtype=jnp.bfloat16)
  natural = jm.library(causal, mesh)["ring"].copy().lower_with(RING)  # the last device: 7.5 of 8 blocks
  assert cost.predict(natural, fast) == pytest.approx(attention * 7.5 / 8 + 20e-6, rel=1e-3)
  zigzag = jm.library(causal, mesh)["ring_zigzag"].copy().lower_with(RING)  # every device: half
  assert cost.predict(zigzag, fast) == pytest.approx(attention / 2 + 20e-6, rel=1e-3)


# ------------------------------------------------------------------ the GPU path, lowered without GPUs


@pytest.mark.parametrize("strategy,lowering,attention", [
    ("async_tp", OURS, False), ("allgather_matmul", "fused_allgather_matmul_comm", False),
    ("async_tp", "fused_allgather_matmul_ws", False), ("matmul_reducescatter", OURS_RS, False),
    ("async_tp_reducescatter", WS_RS, False), ("ring", RING, True), ("ring", "fused_ring_attention_ws", True)])
def test_our_lowerings_lower_for_eight_h100s(strategy, lowering, attention):
  """Each of our fused lowerings' per-device function, as the GPU runs it (no interpret mode), lowers to one
  Mosaic GPU kernel under the schedule's shard_map for an abstract 8 x H100 mesh. (JAX's all-gather kernel reads
  the SM count of a real device, so it has no such check; ``Schedule.compile`` refuses abstract meshes.)"""
  from jax.sharding import NamedSharding

  from jaxmercury.lowering.lower import lower
  mesh = h100_mesh(8)
  prog = (jm.programs.attention(1, 8, 2, 8192, 8192, 128, dtype=jnp.bfloat16) if attention
          else jm.programs.matmul(2048, 2048, 1024, dtype=jnp.bfloat16))
  s = jm.library(prog, mesh)[strategy].copy().lower_with(lowering)
  plan = s.plan()
  specs = [jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=NamedSharding(mesh, plan.user_spec(b.name) or P()))
           for b in prog.reads]
  text = lower_for_gpus(lower(s, per_device=lowering_fused.per_device(s)), *specs,
                        mesh=mesh)
  assert mosaic_kernels(text) == 1


def test_ring_attention_parameters_are_checked_against_the_schedule():
  """lower_with refuses blocks that do not divide the local sequence (or a zigzag chunk) or whose shared memory
  at the program's head dimension does not fit, before anything runs."""
  one = _one_device_mesh()
  s = jm.library(_attention(192), one)["ring"]
  with pytest.raises(jm.PreconditionError, match=r"block_q=128 does not divide each device's positions of 'i' "
                                                 r"\(192\)"):
    s.copy().lower_with(RING, block_q=128)
  wide = jm.library(_attention(256, d=128), one)["ring"]
  with pytest.raises(jm.PreconditionError,
                     match=r"ctas_per_sm=2: 2 CTAs of \d+ bytes of shared memory \(head dim 128\)"):
    wide.copy().lower_with(RING, block_kv=128, ctas_per_sm=2)
  assert wide.copy().lower_with(RING).lowering == RING  # the defaults fit
  assert "at most 192" in placements.why_not(RING, jm.library(_attention(256, d=256), one)["ring"])
  zigzag = jm.library(_attention(384, causal=True), one)["ring_zigzag"]  # two chunks of 192 positions
  with pytest.raises(jm.PreconditionError, match=r"block_kv=128 does not divide each zigzag chunk's positions of "
                                                 r"'i' \(192\)"):
    zigzag.copy().lower_with(RING, block_kv=128)


def test_unverified_placements_are_not_offered(monkeypatch):
  """A lowering not yet verified on GPUs for a placement is left out of what the tuner and the graph search offer
  (lower_with still takes it); in interpret mode, where the tuner checks it on the CPU, it is offered."""
  one, eight = _one_device_mesh(), make_mesh("8")
  s = jm.library(_attention(1024), one)["ring"]
  assert WS_RING in placements.offered(s)  # interpreted here
  ring_untested = lambda p: None if p.size == 1 else f"its ring over {p.size} GPUs has not run"
  as_on_gpus = dataclasses.replace(registry._KERNELS[WS_RING], interpret=False, devices=lambda schedule, p: None,
                                   unverified=ring_untested)
  monkeypatch.setitem(registry._KERNELS, WS_RING, as_on_gpus)
  assert WS_RING in placements.offered(s)
  ring = jm.library(_attention(1024), eight)["ring"]
  assert WS_RING in placements.applicable(ring)
  assert WS_RING not in placements.offered(ring)
  assert ring.copy().lower_with(WS_RING).lowering == WS_RING


def test_every_fused_lowering_has_run_its_rings_on_gpus():
  """Every registered kernel's multi-GPU tests passed on 2 x H200 (the ring attentions' causal and
  warp-specialized rings on 2026-11-23, session 10): none is held back from several GPUs."""
  assert [name for name, low in ((k.name, k) for k in registry.fused_kernels()) if low.unverified is not None] == []
  causal = jm.library(_attention(1024, causal=True), make_mesh("8"))["ring"]
  as_on_gpus = {name: dataclasses.replace(registry._KERNELS[name], interpret=False,
                                          devices=lambda schedule, p: None) for name in (RING, WS_RING)}
  for name, low in as_on_gpus.items():
    assert placements.why_not(low, causal) is None
    with pytest.MonkeyPatch.context() as m:
      m.setitem(registry._KERNELS, name, low)
      assert name in placements.offered(causal)


def test_jax_kernel_refuses_a_one_device_ring(monkeypatch):
  """JAX's all-gather kernel fails at run time on one GPU (XLA sets up no NVSHMEM there): refused beforehand."""
  s = jm.library(_bf16(256, 256, 128), _one_device_mesh())["async_tp"]
  assert "needs several GPUs" not in placements.why_not("jax_allgather_lhs_matmul", s)  # the mesh problem comes first
  monkeypatch.setattr(jax_allgather_matmul, "hopper_devices", lambda every_process_device: lambda p, mesh: None)
  assert "needs several GPUs on mesh level 'x' (it has 1)" in placements.why_not("jax_allgather_lhs_matmul", s)


def test_a_zigzag_order_is_another_kernel():
  """Two schedules storing the same blocks in natural and zigzag order run different kernels: the tuner keeps
  both."""
  one = _one_device_mesh()
  lib = jm.library(_attention(256, causal=True), one)
  natural, zigzag = (lib[name].copy().lower_with(RING) for name in ("ring", "ring_zigzag"))
  assert placements.signature(natural) != placements.signature(zigzag)
  with registry.interpret_mode():
    names = [c.name for c in tune_module.default_candidates(_attention(256, causal=True), one, space=2)]
  assert {f"ring {{{RING}}}", f"ring_zigzag {{{RING}}}"} <= set(names)


@pytest.mark.parametrize("strategy,causal", [("ring", False), ("ring_zigzag", True)])
def test_warp_specialized_ring_attention_lowering_runs_interpreted(strategy, causal):
  """The warp-specialized fused ring attention as a lowering: interpreted on one CPU device, it matches the
  reference and gives the ordinary lowering's gradients without running the attention forward again (the
  program's forward body is not traced: the kernel's output and log-sum-exp feed the dual programs); blocks that
  do not fit the schedule are refused."""
  mesh = _one_device_mesh()
  base, traced = _attention(256, causal=causal, heads=SMALL_HEADS), []

  def body(*blocks, **kwargs):
    traced.append(True)
    return base.body(*blocks, **kwargs)

  prog = dataclasses.replace(base, body=body)
  plain = jm.library(prog, mesh)[strategy]
  s = plain.copy().lower_with("fused_ring_attention_ws", block_kv=64)
  q, k, v = prog.random_inputs(fresh_key())
  f = s.compile()
  out = f(q, k, v)
  assert rel_err(out.astype(jnp.float32), base.reference(q, k, v).astype(jnp.float32)) < 2e-2
  cot = jax.random.normal(fresh_key(), out.shape, jnp.float32).astype(jnp.bfloat16)
  _, vjp = jax.vjp(f, q, k, v)
  grads = vjp(cot)
  assert not traced, "the backward ran the attention forward again"
  _, vjp_plain = jax.vjp(plain.compile(), q, k, v)
  for got, ref in zip(grads, vjp_plain(cot)):
    assert rel_err(got.astype(jnp.float32), ref.astype(jnp.float32)) < 1e-2
  odd = jm.library(_attention(192, causal=causal), mesh)["ring"]  # a work item is 128 query rows
  assert "2 x block_q=128 does not divide each device's positions of 'i' (192)" in placements.why_not(
      "fused_ring_attention_ws", odd)


@pytest.mark.parametrize("lowering,strategy,causal", [(RING, "ring", False), (RING, "ring_zigzag", True)])
def test_a_fused_ring_attentions_gradients_come_from_its_own_residuals(lowering, strategy, causal):
  """Interpreted on one CPU device: dq, dk and dv match the float32 reference's, and differentiating never runs
  the attention forward again (the program's forward body is not traced: the kernel's output and log-sum-exp
  feed the dual programs)."""
  mesh = _one_device_mesh()
  base = _attention(256, causal=causal, heads=SMALL_HEADS)
  traced = []

  def body(*blocks, **kwargs):
    traced.append(True)
    return base.body(*blocks, **kwargs)

  prog = dataclasses.replace(base, body=body)
  s = jm.library(prog, mesh)[strategy].copy().lower_with(lowering, block_kv=64)
  q, k, v = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  f = s.compile()
  out, vjp = jax.vjp(lambda *a: f(*a).astype(jnp.float32), q, k, v)
  grads = vjp(cot)
  assert not traced, "the backward ran the attention forward again"
  f32 = jm.programs.attention(**{**prog.params, "dtype": jnp.float32})
  want, want_vjp = jax.vjp(f32.reference, *(x.astype(jnp.float32) for x in (q, k, v)))
  assert rel_err(out, want) < 2e-2
  for name, got, ref in zip("qkv", grads, want_vjp(cot)):
    assert got.dtype == jnp.bfloat16
    assert rel_err(got.astype(jnp.float32), ref) < 3e-2, f"d{name}"


def _shapes(jaxpr):
  """The shapes of every value ``jaxpr`` and the jaxprs inside it make."""
  for eqn in jaxpr.eqns:
    yield from (v.aval.shape for v in eqn.outvars)
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        yield from _shapes(inner)


@pytest.mark.parametrize("kind,where", [("explicit", "inside"), ("explicit", "outside"), ("auto", "inside")])
def test_a_fused_ring_attention_keeps_its_residuals_apart_on_either_axis_type(kind, where):
  """Interpreted on a one-device mesh of Explicit or Auto axes, inside ``jax.set_mesh`` or not: the forward that
  keeps the backward's residuals returns the output in bf16 and the log-sum-exp apart (no float32 ``[..., d + 1]``
  array is traced; XLA fused the packing away on a GPU, docs/benchmarks.md), and the gradients are the
  reference's."""
  types = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
  mesh = jax.make_mesh((1,), ("x",), axis_types=(types[kind],), devices=jax.devices()[:1])
  prog = _attention(256, causal=True, heads=SMALL_HEADS)
  s = jm.library(prog, mesh)["ring"].copy().lower_with(WS_RING, block_kv=64)
  q, k, v = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  context = jax.set_mesh(mesh) if where == "inside" else contextlib.nullcontext()
  with context:
    f = s.compile()
    step = lambda *a: jax.vjp(lambda *x: f(*x).astype(jnp.float32), *a)[1](cot)
    shapes = list(_shapes(jax.make_jaxpr(step)(q, k, v).jaxpr))
    grads = jax.jit(step)(q, k, v)
  d = prog.params["head_dim"]
  assert not [x for x in shapes if x and x[-1] == d + 1], shapes
  f32 = jm.programs.attention(**{**prog.params, "dtype": jnp.float32})
  _, want_vjp = jax.vjp(f32.reference, *(x.astype(jnp.float32) for x in (q, k, v)))
  for name, got, ref in zip("qkv", grads, want_vjp(cot)):
    assert got.dtype == jnp.bfloat16 and got.shape == ref.shape
    assert rel_err(got.astype(jnp.float32), ref) < 3e-2, f"d{name}"


def test_an_output_leaves_in_parts_only_along_a_whole_last_axis():
  """``lower``'s ``widths`` (an output returned in parts) must sum to the output's last axis."""
  mesh = _one_device_mesh()
  with_lse = dual.with_lse_schedule(jm.library(_attention(256), mesh)["ring"])
  with pytest.raises(ValueError, match=r"output 'olse' cannot leave in parts \(64, 2\) along axis 'e' \(extent 65\)"):
    lower(with_lse, per_device=lambda *blocks: blocks, widths=(64, 2))
