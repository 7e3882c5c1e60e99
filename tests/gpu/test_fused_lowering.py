"""Fused lowerings on real GPUs (skipped on CPU): every GEMM strategy they apply to, with each fused kernel.

``async_tp`` and ``allgather_matmul`` lowered with ``fused_allgather_matmul``,
``fused_allgather_matmul_ws``, ``fused_allgather_matmul_comm`` (ours) and
``jax_allgather_lhs_matmul`` (JAX's), ``matmul_reducescatter`` and
``async_tp_reducescatter`` with ``fused_matmul_reducescatter`` and
``fused_matmul_reducescatter_ws`` (ours), over every local GPU: the output
and both gradients against the float32 reference (the backward is the dual
fused GEMM of the other placement, ``fused_gemm_backward``) and the ordinary
schedule's, and the tuner offering and timing them; ``ring`` and
``context_parallel`` attention, and causal ``ring`` and ``ring_zigzag``,
lowered with both fused ring attentions (outputs and gradients against the
float32 reference: the backward is the dual programs on cuDNN blocks).

Run: ``JAX_PLATFORMS=cuda python3 -m pytest tests/gpu/test_fused_lowering.py -x -q``
"""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import AxisType

import jaxmercury as jm
from gpu.checks import GRAD_TOL, TOL, gpu_mesh
from jaxmercury.analysis import placements
from jaxmercury.kernels import placements as kplacements
from jaxmercury.kernels import registry
from jaxmercury.tuner import autotuner as tune_module
from jaxmercury.tuner import cost, measure

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

STRATEGIES = ("async_tp", "allgather_matmul", "matmul_reducescatter", "async_tp_reducescatter")
KIND = {"async_tp": kplacements.ALLGATHER, "allgather_matmul": kplacements.ALLGATHER,
        "matmul_reducescatter": kplacements.REDUCESCATTER, "async_tp_reducescatter": kplacements.REDUCESCATTER}
PAIRS = [(s, k.name) for s in STRATEGIES for k in registry.fused_kernels() if k.placement == KIND[s]]


def _shape(kind: str):
  n = len(jax.devices())
  # tiled: multiples of every tile; ragged: m that the mesh does not divide (the schedule pads it), and
  # per-device shapes off the kernels' tiles (they pad them)
  return {"tiled": (n * 512, n * 512, 1024), "ragged": (1001, n * 200, 1000)}[kind]


def _check(schedule, plain):
  prog = schedule.program
  a, b = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32).astype(prog.writes.dtype)
  out, vjp = jax.vjp(schedule.compile(), a, b)
  ref_out, ref_vjp = jax.vjp(jnp.dot, a.astype(jnp.float32), b.astype(jnp.float32))
  assert out.shape == ref_out.shape and out.dtype == prog.writes.dtype
  err = rel_err(out.astype(jnp.float32), ref_out)
  assert err < TOL, f"output: rel err {err}\n{schedule}"
  _, plain_vjp = jax.vjp(plain.compile(), a, b)
  for name, g, w, p in zip("AB", vjp(cot), ref_vjp(cot.astype(jnp.float32)), plain_vjp(cot)):
    assert g.dtype == prog.reads[0].dtype
    err = rel_err(g.astype(jnp.float32), w)
    assert err < GRAD_TOL, f"d{name}: rel err {err}\n{schedule}"
    # the dual kernel sums in float32 and rounds once: bf16 roundings apart from the ordinary backward's
    assert rel_err(g.astype(jnp.float32), p.astype(jnp.float32)) < 1e-2, f"d{name} differs from the ordinary one"


@pytest.mark.parametrize("kind", ["tiled", "ragged"])
@pytest.mark.parametrize("strategy,lowering", PAIRS)
def test_every_gpu(strategy, lowering, kind):
  m, n, k = _shape(kind)
  prog = jm.programs.matmul(m, n, k, dtype=jnp.bfloat16)
  plain = jm.library(prog, gpu_mesh())[strategy]
  reason = placements.why_not(lowering, plain)
  if lowering == "jax_allgather_lhs_matmul" and len(jax.devices()) == 1:  # it fails on one GPU at run time
    assert "needs several GPUs" in reason, reason
    return
  assert reason is None, reason
  _check(plain.copy().lower_with(lowering), plain)


def test_one_gpu_of_several():
  """Ours run on a one-device level (no ring), where the reduce-scatter kernel and the one with communication CTAs
  compute what the all-gather kernel does; JAX's kernel needs the level to span several devices, all of them."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.matmul(512, 512, 256, dtype=jnp.bfloat16)
  lib = jm.library(prog, mesh)
  plain = lib["async_tp"]
  for lowering in ("fused_allgather_matmul", "fused_allgather_matmul_ws", "fused_allgather_matmul_comm"):
    _check(plain.copy().lower_with(lowering), plain)
  for lowering in ("fused_matmul_reducescatter", "fused_matmul_reducescatter_ws"):
    _check(lib["matmul_reducescatter"].copy().lower_with(lowering), lib["matmul_reducescatter"])
  reason = placements.why_not("jax_allgather_lhs_matmul", plain)
  assert ("needs several GPUs" if len(jax.devices()) == 1 else "must span every device") in reason, reason
  # the twins the tuner compiles once there (``FusedKernel.one_device``): the all-gather kernel's values, bit for bit
  a, b = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32).astype(prog.writes.dtype)

  def run(s):
    out, vjp = jax.vjp(s.compile(), a, b)
    return (out, *vjp(cot))

  want = run(plain.copy().lower_with("fused_allgather_matmul"))
  for s in (lib["matmul_reducescatter"].copy().lower_with("fused_matmul_reducescatter"),
            plain.copy().lower_with("fused_allgather_matmul_comm")):
    assert placements.runs_as(s)[0] == "fused_allgather_matmul"
    for name, got, w in zip(("output", "dA", "dB"), run(s), want):
      assert bool(jnp.all(got == w)), f"{s.lowering}: {name} differs from fused_allgather_matmul's"


def test_the_tuner_offers_and_times_them():
  m, n, k = _shape("tiled")
  prog = jm.programs.matmul(m, n, k, dtype=jnp.bfloat16)
  mesh = gpu_mesh()
  names = {c.name for c in tune_module.default_candidates(prog, mesh, space=2)}
  lib = jm.library(prog, mesh)
  pairs = [(s, low) for s, low in PAIRS if placements.why_not(low, lib[s]) is None]  # JAX's needs several GPUs

  def verified(s, low):
    unverified = registry.fused(low).unverified
    return unverified is None or unverified(placements.place(low, lib[s])) is None
  assert {f"{s} {{{low}}}" for s, low in pairs if verified(s, low)} <= names, names  # the rest: timed, not offered
  offered = {f"{s} {{{low}}}" for s, low in pairs}
  machine = cost.Machine("test H200", 700e12, {"*": 150e9}, 20e-6)
  candidates = [(s, lib[s]) for s in STRATEGIES] + [(f"{s} {{{low}}}", lib[s].copy().lower_with(low))
                                                    for s, low in pairs]
  result = jm.autotune(prog, mesh, candidates=candidates, machine=machine, iters=5, key=fresh_key(), top_k=12,
                       log=lambda _: None)
  print("\n" + result.table())
  by_name = {c.name: c for c in result.candidates}
  for name in offered:  # timed, or merged into a candidate of the same program that was (one GPU: several are)
    c = by_name[name]
    same = c.result.reason.removeprefix("same program as ") if c.status == measure.PRUNED else name
    assert by_name[same].status == measure.OK, (name, c.result.reason)
  assert result.best is not None


@pytest.mark.parametrize("strategy,causal", [("ring", False), ("context_parallel", False), ("ring", True),
                                             ("ring_zigzag", True)])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("lowering", ["fused_ring_attention", "fused_ring_attention_ws"])
def test_ring_attention_every_gpu(strategy, causal, kv_heads, lowering):
  """The fused ring-attention lowerings: output and gradients against the float32 reference, gradients against the
  ordinary schedule's; the backward runs the dual programs on cuDNN blocks from the kernel's residuals."""
  from jaxmercury.lowering.fused_attention import backward_schedule
  n = len(jax.devices())
  prog = jm.programs.attention(1, 8, kv_heads, n * 1024, n * 1024, 128, causal=causal, dtype=jnp.bfloat16)
  plain = jm.library(prog, gpu_mesh())[strategy]
  assert placements.why_not(lowering, plain) is None
  s = plain.copy().lower_with(lowering)
  assert backward_schedule(s).kernel == "cudnn_attention"
  q, k, v = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  f = s.compile()
  out, vjp = jax.vjp(lambda *a: f(*a).astype(jnp.float32), q, k, v)
  f32 = jm.programs.attention(**{**prog.params, "dtype": jnp.float32})
  ref, ref_vjp = jax.vjp(f32.reference, *(x.astype(jnp.float32) for x in (q, k, v)))
  assert rel_err(out, ref) < TOL
  _, plain_vjp = jax.vjp(plain.compile(), q, k, v)
  grads = vjp(cot)
  for name, g, w, p in zip("qkv", grads, ref_vjp(cot), plain_vjp(cot.astype(jnp.bfloat16))):
    assert g.dtype == jnp.bfloat16
    assert rel_err(g.astype(jnp.float32), w) < GRAD_TOL, f"d{name} against the float32 reference"
    assert rel_err(g.astype(jnp.float32), p.astype(jnp.float32)) < GRAD_TOL, f"d{name} against the ordinary one"
