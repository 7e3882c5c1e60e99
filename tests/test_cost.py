"""The cost model's view of kernel work: fast path, XLA fallback and causal imbalance.

- ``Block``'s positions, causal cases and kept-pair shares against brute force;
- each attention kernel's declared ``work`` against what its block function
  really runs, on CPU with the kernels stood in by markers: for every block
  pair of small schedules (sizes equal and not, zigzag chunks whole and split,
  padded keys), the path taken is the one ``work`` names;
- ``cost.predict``: fallback work at the ``xla`` rate, the busiest device's
  work under a contiguous ring against zigzag and head-parallel strategies,
  non-causal programs as before.
"""

import dataclasses
import itertools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

import jaxmercury as jm
from jaxmercury.analysis.plan import make_plan
from jaxmercury.graph.options import _without_output_placement
from jaxmercury.ir import orders
from jaxmercury.ir.program import BlockContext
from jaxmercury.kernels import registry
from jaxmercury.kernels.attention import cudnn as ca
from jaxmercury.kernels.attention import mosaic as ma
from jaxmercury.kernels.work import Block, Work, body_share
from jaxmercury.programs import attention_backward as ab
from jaxmercury.tuner import calibrate, cost, stored
from jaxmercury.tuner.config import Task

FAST, SLOW = 500e12, 100e12
MACHINE = cost.Machine("H200-like", FAST, {"*": 200e9}, 20e-6, call_overhead_s=0.0, memory_bytes_per_s=1e30,
                       kernel_flops_per_s={"xla": SLOW, "cudnn_attention": FAST, "mosaic_attention": FAST,
                                           "pallas_attention": FAST / 4})


def _abstract(*sizes):
  names = ("x",) if len(sizes) == 1 else ("node", "gpu")
  return AbstractMesh(tuple(sizes), names, axis_types=(AxisType.Auto,) * len(sizes))


def _true_positions(axis, start, size, extent, zigzag):
  stored = np.arange(start, start + size)
  return orders.permutation(extent, zigzag[axis])[stored] if axis in zigzag else stored


# ------------------------------------------------------------------ Block
@pytest.mark.parametrize("zigzag", [{}, {"i": 4, "j": 4}, {"i": 8, "j": 8}], ids=["plain", "chunks4", "chunks8"])
def test_block_positions_cases_and_shares_match_brute_force(zigzag):
  extent = 32
  for tq, tk in [(8, 8), (8, 16), (16, 8), (4, 8)]:
    for qs, ks in itertools.product(range(0, extent, tq), range(0, extent, tk)):
      block = Block({"i": tq, "j": tk}, {"i": extent, "j": extent}, {"i": qs, "j": ks}, zigzag)
      qpos = _true_positions("i", qs, tq, extent, zigzag)
      kpos = _true_positions("j", ks, tk, extent, zigzag)
      assert sorted(p for lo, hi in block.ranges("i") for p in range(lo, hi)) == sorted(qpos)
      ctx = BlockContext({"i": qs, "j": ks}, {"i": tq, "j": tk}, {"i": extent, "j": extent}, zigzag)
      assert block.contiguous("i") == ctx.contiguous("i") and block.contiguous("j") == ctx.contiguous("j")
      kept = kpos[None, :] <= qpos[:, None]
      want = "visible" if kept.all() else ("hidden" if not kept.any() else "partial")
      assert block.causal_case() == want
      assert block.causal_share() == pytest.approx(kept.mean())


def test_padded_keys_are_not_kept():
  block = Block({"i": 8, "j": 8}, {"i": 30, "j": 30}, {"i": 24, "j": 24})
  assert block.padded("j") and block.causal_share() == pytest.approx((1 + 2 + 3 + 4 + 5 + 6 + 6 + 6) / 64)


# ------------------------------------------------------------------ work against the block functions
MARKS = {"kernel": 1.0, "kernel_causal": 2.0, "fallback": 3.0, "kernel_bias": 4.0}  # masked blocks give 0


def _forward_fallback(ctx, q, k, v):
  return jnp.full(q.shape, MARKS["fallback"], jnp.float32), jnp.zeros(q.shape[:4])


def _dq_fallback(ctx, q, *rest):
  return jnp.full(q.shape, MARKS["fallback"], jnp.float32)


def _mark(causal, keep=None):
  return MARKS["kernel_bias" if keep is not None else "kernel_causal" if causal else "kernel"]


def _forward_stub(q, k, v, causal, window=None, keep=None):
  return jnp.full(q.shape, _mark(causal, keep), jnp.float32), jnp.zeros(q.shape[:4])


def _backward_stub(q, k, v, o, do, lse, causal, window=None, keep=None):
  mark = _mark(causal, keep)
  return jnp.full(q.shape, mark), jnp.full(k.shape, mark), jnp.full(k.shape, mark)


def _taken(value) -> str:
  value = float(np.max(np.asarray(value)))  # a bias path zeroes the rows that keep no key
  return {0.0: "masked", **{v: k for k, v in MARKS.items()}}[value]


def _expect(work: Work, block: Block, causal: bool) -> str:
  if work.fallback:
    return "fallback"
  if work.fast == 0:
    return "masked or fallback"  # a hidden block: skipped by the kernel or by the body alike
  return "kernel_causal" if work.fast < 1 else "kernel or kernel_bias"


def _blocks(extent, sizes, d, zigzags, padded_extent=None):
  """Every block pair of an [extent] x [extent] causal attention at ``sizes`` (and a padded variant)."""
  for (tq, tk), zigzag in itertools.product(sizes, zigzags):
    for true_extent in filter(None, {extent, padded_extent}):
      if zigzag and true_extent != extent:
        continue  # zigzag needs an unpadded axis
      extents = {"b": 1, "hk": 1, "g": 1, "i": true_extent, "j": true_extent, "d": d}
      for qs, ks in itertools.product(range(0, extent, tq), range(0, extent, tk)):
        yield Block({"b": 1, "hk": 1, "g": 1, "i": tq, "j": tk, "d": d}, extents, {"i": qs, "j": ks}, zigzag)


def _check_dispatch(run, work, blocks, causal):
  seen = set()
  for block in blocks:
    ctx = BlockContext(dict(block.starts), dict(block.sizes), dict(block.extents), dict(block.zigzag))
    taken = _taken(run(ctx, block))
    expected = _expect(work(block), block, causal)
    assert taken in expected.split(" or "), (block, taken, work(block))
    if taken == "fallback":  # the body runs densely unless the block is hidden
      assert work(block).fallback == body_share(block, causal)
    if taken == "kernel_causal":
      assert work(block).fast == pytest.approx(block.causal_share())
    seen.add(taken)
  return seen


def _inputs(block, backward=False):
  s = block.sizes
  q = jnp.zeros((1, s["i"], 1, 1, s["d"]), jnp.bfloat16)
  k = jnp.zeros((1, s["j"], 1, s["d"]), jnp.bfloat16)
  if not backward:
    return q, k, k
  return q, k, k, q, q, jnp.zeros((1, s["i"], 1, 1), jnp.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_work_is_what_its_blocks_run(monkeypatch, causal):
  monkeypatch.setattr(ca, "_cudnn", _forward_stub)
  monkeypatch.setattr(ca, "_cudnn_backward_masked", _backward_stub)
  kernel = registry.kernel("cudnn_attention")
  prog = jm.programs.attention(1, 1, 1, 32, 32, 8, causal=causal, dtype=jnp.bfloat16)
  blocks = list(_blocks(32, [(8, 8), (8, 16), (16, 8)], 8, [{}, {"i": 4, "j": 4}, {"i": 8, "j": 8}], 30))

  def forward(ctx, block):
    return ca.cudnn_attention_block(ctx, *_inputs(block), mask=mask, fallback=_forward_fallback)[0]

  mask = jm.programs.AttentionMask(causal=causal)
  seen = _check_dispatch(forward, lambda b: kernel.block_work(prog, b), blocks, causal)
  assert seen == ({"kernel", "kernel_causal", "kernel_bias", "masked", "fallback"} if causal
                  else {"kernel", "fallback"})

  dq_prog = ab.attention_dq(prog)
  dq_kernel = registry.kernel("cudnn_attention_dq")

  def backward(ctx, block):
    return ca.cudnn_backward_block(ctx, *_inputs(block, backward=True), mask=mask, part="dq",
                                   fallback=_dq_fallback)

  _check_dispatch(backward, lambda b: dq_kernel.block_work(dq_prog, b), blocks, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_mosaic_work_is_what_its_blocks_run(monkeypatch, causal):
  monkeypatch.setattr(ma, "forward", lambda q, k, v, config: _forward_stub(q, k, v, config.causal))
  monkeypatch.setattr(ma, "backward", lambda *x: _backward_stub(*x[:6], False))
  prog = jm.programs.attention(1, 1, 1, 512, 512, 64, causal=causal, dtype=jnp.bfloat16)
  blocks = list(_blocks(512, [(256, 256), (256, 128), (128, 256)], 64, [{}, {"i": 2, "j": 2}, {"i": 8, "j": 8}],
                        500))
  blocks += list(_blocks(512, [(256, 256)], 32, [{}]))  # a head dim the kernels do not take
  params = dataclasses.asdict(ma.ForwardConfig())

  def forward(ctx, block):
    return ma.mosaic_attention_block(ctx, *_inputs(block), causal=causal, params=params,
                                     fallback=_forward_fallback)[0]

  kernel = registry.kernel("mosaic_attention")
  seen = _check_dispatch(forward, lambda b: kernel.block_work(prog, b), blocks, causal)
  assert seen == ({"kernel", "kernel_causal", "masked", "fallback"} if causal else {"kernel", "fallback"})

  dq_prog = ab.attention_dq(prog)
  dq_params = dataclasses.asdict(ma.DqConfig())

  def backward(ctx, block):
    return ma.mosaic_backward_block(ctx, *_inputs(block, backward=True), causal=causal, part="dq",
                                    params=dq_params, fallback=_dq_fallback)

  dq_kernel = registry.kernel("mosaic_attention_dq")
  _check_dispatch(backward, lambda b: dq_kernel.block_work(dq_prog, b), blocks, causal)


def test_kernels_without_declared_work():
  prog = jm.programs.attention(1, 1, 1, 32, 32, 8, causal=True)
  diagonal = Block({"i": 8, "j": 8}, {"i": 32, "j": 32}, {"i": 8, "j": 8})
  hidden = Block({"i": 8, "j": 8}, {"i": 32, "j": 32}, {"i": 0, "j": 8})
  xla, pallas = registry.kernel("xla"), registry.kernel("pallas_attention")
  assert xla.block_work(prog, diagonal) == Work(fast=1.0) and xla.block_work(prog, hidden) == Work(fast=0.0)
  assert pallas.block_work(prog, diagonal) == Work(fast=diagonal.causal_share())  # skips masked tiles
  plain = jm.programs.attention(1, 1, 1, 32, 32, 8)
  assert xla.block_work(plain, hidden) == pallas.block_work(plain, hidden) == Work()


# ------------------------------------------------------------------ predict
def _causal(seq=8192, heads=32, kv_heads=32):
  return jm.programs.attention(1, heads, kv_heads, seq, seq, 128, causal=True, dtype=jnp.bfloat16)


def _patched(schedule, kernel):
  return schedule.copy().patch(kernel) if kernel != "xla" else schedule


def test_partly_visible_blocks_of_two_sizes_cost_dense_cudnn():
  """Causal context_parallel: query blocks of S/2, key blocks of S, all partly visible: cuDNN with a bias, the
  whole block at cuDNN's rate (the XLA body would take them at its own)."""
  prog, mesh = _causal(), _abstract(2)
  cp = jm.library(prog, mesh)["context_parallel"]
  dense_per_device = 2 * prog.flops / 2
  assert cost.compute_seconds(_patched(cp, "cudnn_attention"), MACHINE) == pytest.approx(dense_per_device / FAST)
  assert cost.compute_seconds(cp, MACHINE) == pytest.approx(dense_per_device / SLOW)
  # Heads over the devices and every block square: cuDNN takes everything, the diagonal by its causal mask.
  ulysses = _patched(jm.library(prog, mesh)["ulysses"], "cudnn_attention")
  assert cost.compute_seconds(ulysses, MACHINE) == pytest.approx(prog.flops / 2 / FAST, rel=1e-3)


def test_uneven_causal_blocks_compute_their_diagonal_densely():
  prog, mesh = _causal(), _abstract(2)
  even = jm.Schedule(prog, mesh).tile("i", 2, names=("i0", "i_in")).parallelize("i0", "x")
  even.tile("j", 2, names=("j0", "j_in")).shift("j0", "i0")
  uneven = even.copy().tile("i_in", 2)  # query blocks half the key blocks: partly visible ones take a bias
  t_even, t_uneven = (cost.compute_seconds(_patched(s, "cudnn_attention"), MACHINE) for s in (even, uneven))
  assert t_even < t_uneven < cost.compute_seconds(uneven, MACHINE)


@pytest.mark.parametrize("devices", [2, 4])
def test_contiguous_ring_is_set_by_its_busiest_device(devices):
  prog, mesh = _causal(), _abstract(devices)
  lib = jm.library(prog, mesh)
  for kernel in ("cudnn_attention", "pallas_attention"):
    t = {name: cost.compute_seconds(_patched(lib[name], kernel), MACHINE) for name in ("ring", "ring_zigzag",
                                                                                        "ulysses")}
    balanced = prog.flops / devices / MACHINE.rate(kernel)
    assert t["ulysses"] == pytest.approx(balanced, rel=1e-3)
    # Rank r holds queries [r S/n, (r+1) S/n): the last rank keeps (2n - 1) / n times the mean.
    assert t["ring"] == pytest.approx(balanced * (2 * devices - 1) / devices, rel=1e-3)
    assert t["ring_zigzag"] == pytest.approx(balanced, rel=1e-3)


def test_two_level_ring_imbalance():
  prog, mesh = _causal(32768), _abstract(2, 2)
  lib = jm.library(prog, mesh)
  t = {name: cost.compute_seconds(_patched(lib[name], "cudnn_attention"), MACHINE) for name in ("ring", "usp",
                                                                                                 "ring_zigzag")}
  balanced = prog.flops / 4 / FAST
  assert t["ring"] == pytest.approx(balanced * 7 / 4, rel=1e-3)
  assert t["usp"] == pytest.approx(balanced * 3 / 2, rel=1e-3)  # heads over gpu, a contiguous ring over node
  assert t["ring_zigzag"] == pytest.approx(balanced, rel=1e-3)


def test_zigzag_order_costs_chunk_exchanges_not_whole_arrays():
  """On 2 devices each buffer's block goes in 2 ppermute rounds: at most the block, never the whole array."""
  prog, mesh = _causal(), _abstract(2)
  lib = jm.library(prog, mesh)
  zz = lib["ring_zigzag"]
  sizes = [math.prod(b.canonical_shape) * b.dtype.itemsize for b in prog.reads + (prog.writes,)]
  want = sum(2 * MACHINE.latency_s + nb / 2 / MACHINE.bandwidth("gpu") + nb / MACHINE.memory_bytes_per_s
             for nb in sizes)
  assert cost._zigzag_seconds(zz, MACHINE, make_plan(zz)) == pytest.approx(want)
  assert cost._zigzag_seconds(lib["ring"], MACHINE, make_plan(lib["ring"])) == 0.0


@pytest.mark.parametrize("kernel", ["xla", "cudnn_attention", "mosaic_attention"])
def test_non_causal_compute_is_flops_over_rate(kernel):
  prog = jm.programs.attention(1, 32, 8, 8192, 8192, 128, dtype=jnp.bfloat16)
  mesh = _abstract(2, 2)
  for name, s in jm.library(prog, mesh).items():
    s = _patched(s, kernel)
    parallel = math.prod(s.levels[lp.level] for lp in s.loops if lp.role == "parallel")
    assert cost.compute_seconds(s, MACHINE) == pytest.approx(prog.flops / parallel / MACHINE.rate(kernel)), name


def test_padded_keys_fall_back_for_cudnn():
  prog = jm.programs.attention(1, 8, 8, 1001, 1001, 64, dtype=jnp.bfloat16)
  ring = jm.library(prog, _abstract(8))["ring"]
  assert ring.padded["j"] == 1008
  assert cost.compute_seconds(_patched(ring, "cudnn_attention"), MACHINE) == pytest.approx(
      cost.compute_seconds(ring, MACHINE))


def test_prediction_is_cheap():
  import time
  prog, mesh = _causal(32768), _abstract(4, 4)
  schedules = [_patched(s, k) for s in jm.library(prog, mesh).values() for k in ("xla", "cudnn_attention")]
  t0 = time.perf_counter()
  for s in schedules:
    cost.predict(s, MACHINE)
  assert (time.perf_counter() - t0) / len(schedules) < 0.05


# ------------------------------------------------------------------ calibration's flops
def test_calibration_counts_executed_flops():
  prog = _causal()
  sizes = {"b": 1, "hk": 32, "g": 1, "i": 4096, "j": 4096, "d": 128}
  counted = prog.flops / 4
  assert calibrate.executed_flops(prog, "xla", sizes) == pytest.approx(2 * counted)  # dense on the diagonal
  assert calibrate.executed_flops(prog, "cudnn_attention", sizes) == pytest.approx(counted, rel=1e-3)
  kernel = registry.kernel("cudnn_attention")
  for shrink in (1, 8):
    square = calibrate._block_sizes(prog, kernel, 1 << 30, shrink)
    assert square["i"] == square["j"]


def test_calibration_blocks_stay_under_the_flops_cap():
  """A long sequence calibrates on blocks no larger than the cap, not on the whole sequence."""
  prog = jm.programs.attention(1, 32, 8, 131072, 131072, 128)
  kernel = registry.kernel("cudnn_attention")
  uncapped = calibrate._block_sizes(prog, kernel, 8 << 30)
  capped = calibrate._block_sizes(prog, kernel, 8 << 30, max_flops=calibrate.GPU_BLOCK_FLOPS)
  flops = lambda sizes: cost.dense_flops(prog) * math.prod(sizes[a] / ax.extent for a, ax in prog.axes.items())
  assert flops(uncapped) > calibrate.GPU_BLOCK_FLOPS >= flops(capped) > calibrate.GPU_BLOCK_FLOPS / 2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_attention_rates_are_measured_on_one_device(monkeypatch, causal):
  """``fused_rates`` runs each fused ring attention on one device at ``seq``: its executed flops over its time;
  programs other than attention get none."""
  seconds = 2e-3
  seen = []

  def fake_time(fn, *inputs):  # runs the kernel once (interpret mode); a fixed time
    out = np.asarray(fn(*inputs).astype(jnp.float32))
    assert np.isfinite(out).all() and np.abs(out).max() > 0
    seen.append(inputs[0].shape)
    return seconds

  monkeypatch.setattr(calibrate, "_time", fake_time)
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.attention(1, 4, 2, 4096, 4096, 64, causal=causal, dtype=jnp.bfloat16)
  rates = calibrate.fused_rates(prog, mesh, seq=256)
  assert set(rates) == {"fused_ring_attention", "fused_ring_attention_ws"}
  executed = 4 * 4 * 256 * 256 * 64 * (0.5 if causal else 1)
  assert all(r == pytest.approx(executed / seconds) for r in rates.values()), rates
  assert seen == [(1, 256, 4, 64)] * 2
  assert calibrate.fused_rates(jm.programs.matmul(256, 256, 256, dtype=jnp.bfloat16), mesh) == {}

  def broken(fn, *inputs):
    raise RuntimeError("the kernel failed")
  monkeypatch.setattr(calibrate, "_time", broken)
  with pytest.warns(RuntimeWarning) as caught:
    assert calibrate.fused_rates(prog, mesh, seq=256) == {}
  assert sorted(str(w.message).split(" did not")[0] for w in caught) == ["calibrate: fused_ring_attention",
                                                                         "calibrate: fused_ring_attention_ws"]
  assert all("the kernel failed" in str(w.message) for w in caught)


def test_fused_gemm_rates_are_measured_on_the_mesh(monkeypatch):
  """``fused_gemm_rates`` runs each fused GEMM lowering offered for the program under the first library schedule
  it lowers, dispatched back to back, on inputs in that schedule's layouts: the program's flops per device over
  the time of one call; on one device those that run another's program there take its rate, timed once; programs
  other than GEMMs get none, and a kernel that fails is left out with a warning."""
  seconds, seen = 4e-3, []

  def fake_pipelined(fn, *inputs):  # runs the kernel once (interpret mode); a fixed time
    a, b = inputs
    out = np.asarray(fn(*inputs).astype(jnp.float32))
    want = np.asarray(a.astype(jnp.float32)) @ np.asarray(b.astype(jnp.float32))
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 2e-2
    seen.append(a.shape)
    return seconds

  monkeypatch.setattr(calibrate, "_pipelined", fake_pipelined)
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.matmul(256, 256, 128, dtype=jnp.bfloat16)
  with registry.interpret_mode():
    rates = calibrate.fused_gemm_rates(prog, mesh)
  assert set(rates) == {"fused_allgather_matmul", "fused_allgather_matmul_comm", "fused_matmul_reducescatter"}
  assert all(r == pytest.approx(2 * 256 * 256 * 128 / seconds) for r in rates.values()), rates
  assert seen == [(256, 128)]  # the reduce-scatter and communication-CTA kernels run the all-gather one's program
  assert calibrate.fused_gemm_rates(jm.programs.attention(1, 4, 2, 256, 256, 64, dtype=jnp.bfloat16), mesh) == {}
  monkeypatch.setattr(calibrate, "_pipelined", lambda fn, *inputs: (_ for _ in ()).throw(RuntimeError("it failed")))
  with pytest.warns(RuntimeWarning, match="fused_allgather_matmul did not run on the mesh .*it failed"):
    with registry.interpret_mode():
      assert calibrate.fused_gemm_rates(prog, mesh) == {}


def test_fused_attention_probe_length(monkeypatch):
  """The default probe: the longest multiple of 256 whose work fits ``FUSED_PROBE_FLOPS``, at most the keys."""
  lengths = []
  monkeypatch.setattr(calibrate, "_time", lambda fn, *inputs: lengths.append(inputs[0].shape[1]) or 1.0)
  monkeypatch.setattr(jm.Schedule, "compile", lambda self, differentiable=True: lambda *x: x[0])
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  calibrate.fused_rates(jm.programs.attention(1, 32, 8, 131072, 131072, 128, causal=True, dtype=jnp.bfloat16), mesh)
  (seq,) = set(lengths)
  assert seq % 256 == 0 and 4 * 32 * seq ** 2 * 128 <= calibrate.FUSED_PROBE_FLOPS < 4 * 32 * (seq + 256) ** 2 * 128
  lengths.clear()
  calibrate.fused_rates(jm.programs.attention(1, 4, 4, 512, 512, 64, dtype=jnp.bfloat16), mesh)
  assert set(lengths) == {512}  # the program's own keys where they are fewer


def test_partial_state_counts_each_leaf_in_its_own_shape():
  """An attention partial result is its float32 output block plus a log-sum-exp without the head dimension (not
  two output blocks); a GEMM's is its output block."""
  mesh = _abstract(4)
  att = jm.programs.attention(2, 8, 2, 256, 1024, 128, dtype=jnp.bfloat16)
  tree = jm.library(att, mesh)["tree"]  # keys split over the devices, every device holds all queries
  assert [len(leaf) for leaf in att.state_axes()] == [len(att.writes.axes), len(att.writes.axes) - 1]
  assert cost.partial_state_bytes(tree, make_plan(tree)) == 4 * (2 * 256 * 8 * 128 + 2 * 256 * 8)
  gemm = jm.programs.matmul(64, 32, 48)
  tp = jm.library(gemm, mesh)["matmul_reducescatter"]  # k split: each device holds a partial [64, 32]
  assert cost.partial_state_bytes(tp, make_plan(tp)) == 4 * 64 * 32


def test_backward_prices_the_gradients_products_and_the_transposed_collectives():
  """A GEMM's backward is two products of each block; the all-gather of A becomes a reduce-scatter of dA (the
  same bytes); an output reduce-scattered over a level becomes an all-gather of its block, an all-reduced one
  nothing. An attention block's backward is 2.5 times its forward's work, on cuDNN's blocks."""
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  machine = cost.Machine("h200-ish", 600e12, {"*": 150e9}, 20e-6, call_overhead_s=0.0)
  lib = jm.library(jm.programs.matmul(8192, 4096, 14336, dtype=jnp.bfloat16), mesh)
  local = lib["data_parallel"]  # no communication
  assert cost.backward_seconds(local, machine) == pytest.approx(2 * cost.predict(local, machine))
  gathered = lib["allgather_matmul"]  # gather A, then one product: its backward, the same transfer and two
  assert cost.backward_seconds(gathered, machine) - cost.predict(gathered, machine) == pytest.approx(
      cost.compute_seconds(gathered, machine))
  scattered = lib["matmul_reducescatter"]  # C's rows split over x after the reduction over k
  block = 8192 // 8 * 4096 * 2
  assert cost.backward_seconds(scattered, machine) == pytest.approx(
      2 * cost.compute_seconds(scattered, machine) + block * 7 / 150e9 + 20e-6)
  reduced = _without_output_placement(scattered)  # the same reduction, all-reduced: its transpose moves nothing
  assert reduced.plan().reductions and cost.predict(reduced, machine) > cost.predict(local, machine)
  assert cost.backward_seconds(reduced, machine) == pytest.approx(2 * cost.compute_seconds(reduced, machine))
  prog = jm.programs.attention(1, 32, 8, 8192, 8192, 128, dtype=jnp.bfloat16)
  heads = jm.library(prog, mesh)["ulysses"]
  fast = dataclasses.replace(machine.with_links(x=1e30), latency_s=0.0)
  assert cost.backward_seconds(heads, fast) == pytest.approx(2.5 * cost.compute_seconds(heads, fast), rel=1e-6)
  # on GPUs every attention backward runs cuDNN's blocks, whatever the forward's: its rate, not XLA's, counts
  slow_backward = dataclasses.replace(fast, backward_flops_per_s={"cudnn_attention": 300e12})  # half the forward's
  assert cost.backward_seconds(heads, slow_backward) == pytest.approx(
      2 * cost.backward_seconds(heads, fast), rel=1e-6)
  assert cost.predict(heads, slow_backward) == cost.predict(heads, fast)
  slow_xla = dataclasses.replace(fast, backward_flops_per_s={"xla": 300e12})
  assert cost.backward_seconds(heads, slow_xla) == pytest.approx(cost.backward_seconds(heads, fast), rel=1e-6)


def test_backward_rates_time_the_joint_block_on_the_forwards_blocks():
  """``backward_rates``: the joint dq and dk-dv block of each kernel that has one, on the blocks the forward's rate
  is measured on, counted as 2.5 forwards; kernels without a joint block, and GEMMs, get none."""
  one = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.attention(1, 4, 2, 256, 256, 32, causal=True)
  timed = []

  def spy(program, fn, sizes, device):
    timed.append((program.name, dict(sizes)))
    return [(None, ()), (None, ())]

  with pytest.MonkeyPatch.context() as m:
    m.setattr(calibrate, "_kernel_probes", spy)
    m.setattr(calibrate, "_warm", lambda probes: None)
    m.setattr(calibrate, "_per_repeat", lambda probes: 1e-3)
    rates = calibrate.backward_rates(prog, one, ["xla", "pallas_attention"])
  assert set(rates) == {"xla"} and rates["xla"] > 0  # pallas_attention's dq and dk-dv have no joint block
  assert [name for name, _ in timed] == [ab.attention_dq(prog).name]  # one block size: a rate, no fixed cost
  sizes = timed[0][1]  # the forward's larger block: its flops over its time
  assert rates["xla"] == pytest.approx(2.5 * calibrate.executed_flops(prog, "xla", sizes) / 1e-3)
  assert calibrate.backward_rates(jm.programs.matmul(64, 64, 64), one, ["xla"]) == {}
  measured = calibrate.backward_rates(prog, one, ["xla"])  # the real block runs
  assert measured["xla"] > 0


@pytest.mark.parametrize("devices", [1, 4])
def test_ring_attention_rates_are_calibrated_only_where_offered(monkeypatch, devices):
  """On a GPU mesh of one device the tuner offers no ring attention (``propose.ONE_DEVICE_RING``): the kernels'
  calibration skips their rates there, and measures them on a mesh of several devices. (The measurements are
  stubbed: a mesh whose devices call themselves GPUs, the parts each step measures recorded.)"""
  calls = []
  monkeypatch.setattr(calibrate, "kernel_rates", lambda *a, **k: ({"xla": 1e12}, 0.0))
  monkeypatch.setattr(calibrate, "fused_rates", lambda *a, **k: calls.append("rings") or {"fused_ring_attention": 1.0})
  monkeypatch.setattr(calibrate, "fused_gemm_rates", lambda *a, **k: calls.append("gemms") or {})
  monkeypatch.setattr(calibrate, "backward_rates", lambda *a, **k: {})
  gpu = types.SimpleNamespace(platform="gpu")
  mesh = types.SimpleNamespace(devices=np.array([gpu] * devices), axis_names=("x",), shape={"x": devices})
  prog = jm.programs.attention(1, 4, 2, 256, 256, 64, causal=True, dtype=jnp.bfloat16)
  figures = calibrate.measure_parts(prog, mesh, parts=(calibrate.KERNELS,))[calibrate.KERNELS]
  assert calls == (["gemms"] if devices == 1 else ["rings", "gemms"])
  assert ("fused_ring_attention" in figures["fused_flops_per_s"]) == (devices > 1)


def test_gpu_kernel_probes_compile_one_loop_per_size_timed_pipelined(monkeypatch):
  """On GPUs a kernel's probe at one block size is one loop of ``REPEATS`` (one compile, where two loops would
  compile the kernel twice), its calls timed back to back: seconds per repeat are a call's over ``REPEATS``."""
  one = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.matmul(64, 32, 48)
  sizes = {a: ax.extent for a, ax in prog.axes.items()}
  fn = registry.lookup("xla", prog, one)
  probes = calibrate._kernel_probes(prog, fn, sizes, one.devices.flat[0], pipelined=True)
  assert len(probes) == 1
  run, args = probes[0]
  a, b = jax.block_until_ready(run(*args))  # the loop hands its blocks on, nudged by nothing
  np.testing.assert_array_equal(np.asarray(a), np.asarray(args[1]))
  assert np.abs(np.asarray(a)).max() > 0 and b.shape == args[2].shape
  seen = []

  def pipelined(f, *xs, calls):  # one call of the loop takes 8 ms
    seen.append((calls, f is run, len(xs) == len(args)))
    return 8e-3
  monkeypatch.setattr(calibrate, "_pipelined", pipelined)
  assert calibrate._per_repeat(probes) == pytest.approx(8e-3 / calibrate.REPEATS)
  assert seen == [(calibrate.PIPELINED_CALLS, True, True)]
  assert len(calibrate._kernel_probes(prog, fn, sizes, one.devices.flat[0])) == 2  # on CPUs: two calls of one loop


def test_backward_blocks_are_calibrated_by_the_first_training_tune(monkeypatch, tmp_path):
  """A forward tune's calibration stores the kernels' part without its backward blocks (on GPUs, where they are
  measured: stubbed here); the first training tune measures them once and stores them beside the rest."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.attention(1, 4, 2, 256, 256, 64, causal=True)
  task, db, lines = Task(prog, mesh), jm.Database(tmp_path / "tuning.db"), []
  kernels = {"flops_per_s": 2e12, "kernel_flops_per_s": {"xla": 2e12}, "call_overhead_s": 1e-5,
             "fused_flops_per_s": {}}
  asked, backward = [], []
  monkeypatch.setattr(stored, "measure_parts", lambda *a, parts, backward, **k: asked.append(backward) or {
      calibrate.MESH: {"link_bytes_per_s": {"*": 1e12}, "latency_s": 0.0, "gather_factor": 1.0, "overlap": 1.0,
                       "memory_bytes_per_s": 1e12}, calibrate.KERNELS: dict(kernels)})
  monkeypatch.setattr(calibrate, "backward_rates", lambda p, m, rates: backward.append(dict(rates)) or {"xla": 1e12})
  forward = stored.machine(task, None, db, lines.append)
  assert asked == [False] and forward.backward_flops_per_s == {} and backward == []
  assert calibrate.BACKWARD not in db.machine_parts(prog, mesh)[calibrate.KERNELS]
  for _ in range(2):  # the second training tune reads them
    training = stored.machine(task, None, db, lines.append, training=True)
    assert training.backward_flops_per_s == {"xla": 1e12} and training.kernel_flops_per_s == {"xla": 2e12}
  assert asked == [False] and backward == [{"xla": 2e12}]
  assert db.machine_parts(prog, mesh)[calibrate.KERNELS][calibrate.BACKWARD] == {"xla": 1e12}
  assert sum("backward blocks" in line for line in lines) == 2  # the measurement's two lines, once


def test_every_kernels_probes_compile_at_once_before_any_is_timed(monkeypatch):
  """``kernel_rates`` and ``backward_rates`` hand every kernel's probes to one ``_warm`` (one kernel's lowering
  overlaps another's compile), then time each kernel (stubbed: the order of the calls is what is checked)."""
  one = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.attention(1, 4, 2, 256, 256, 32, causal=True)
  events = []
  monkeypatch.setattr(calibrate, "_kernel_probes", lambda program, fn, sizes, device: [(object(), ()), (object(), ())])
  monkeypatch.setattr(calibrate, "_warm", lambda probes: events.append(("warm", len(probes))))
  monkeypatch.setattr(calibrate, "_per_repeat", lambda probes: events.append(("time",)) or 1e-3)
  with registry.interpret_mode():
    rates, _ = calibrate.kernel_rates(prog, one, ["xla", "pallas_attention"], progress=events.append)
    assert set(rates) == {"xla", "pallas_attention"}
    assert events == ["kernel xla", ("warm", 8), ("time",), ("time",), "kernel pallas_attention", ("time",),
                      ("time",)]
    events.clear()
    assert set(calibrate.backward_rates(prog, one, ["pallas_attention", "xla"])) == {"xla"}  # the one with a joint
    assert events == [("warm", 2), ("time",)]  # one block size
