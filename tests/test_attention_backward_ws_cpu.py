"""Our one-pass attention backward kernel and ``ws_attention`` without a GPU.

The kernel (``kernels.attention.ws_backward``) runs in Mosaic GPU interpret mode on one device against the float32
derivative of plain attention: with and without a mask, grouped K/V (each query head an item, dk and dv added
across them) and not, head dimensions 64 and 128, the queries whole and in chunks; its input checks; its lowering
for abstract H100s (the overlapped waits and the consumers' copies per warpgroup that the interpreter does not
run). ``ws_attention`` (our forward and our backward as a local kernel) on blocks at traced ring offsets against
the programs' own bodies, in one-device schedules and a fused ring attention configured with
``backward="ws_attention"``, forward and gradients; on the 8-device mesh (where the interpreter cannot run: it
keeps one state for all devices) with its kernels stood in by XLA, which shows the ring's dk-dv partials travel
right. The tuner offers our backward in training tunes, on GPUs too, and leaves a kernel marked unverified out
there.
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, h100_mesh, lower_for_gpus, make_mesh, mosaic_kernels, rel_err
from jax.sharding import AxisType
from ring_attention_checks import backward_problem, grouped_reference
from test_training import _check_grads

import jaxmercury as jm
from jaxmercury.errors import PreconditionError
from jaxmercury.kernels import registry
from jaxmercury.kernels.attention import ws as ws_attention
from jaxmercury.kernels.attention import ws_backward
from jaxmercury.kernels.attention.ws_backward import BackwardBlocks, attention_backward_ws, auto_chunks
from jaxmercury.programs import attention_backward as ab
from jaxmercury.programs.attention import attention_block
from jaxmercury.schedules import dual
from jaxmercury.tuner import autotuner

GRAD_TOL = 2e-2  # bf16 inputs: gradients' relative norm error


# (b, s_q, s_kv, h, kv, d, causal, query chunks): one CTA per item, b * h * s_kv / 128 items (one a chunk of them);
# grouped K/V sums its heads' dk and dv; MHA stores them (causal: one copy of the consumers' code, dq sent at once;
# without a mask the dq deferred to the next step's fence); head dimensions 64 (each consumer all of dq's columns)
# and 128 (half each). Chunks whose ends cut a causal key pair; chunks without a mask.
KERNEL_CASES = [(1, 256, 256, 2, 1, 64, True, None),
                (1, 128, 384, 2, 1, 128, False, None),  # more keys than queries
                (1, 256, 256, 2, 2, 64, True, None),  # MHA
                (2, 128, 256, 2, 2, 64, False, None),  # MHA
                (1, 256, 256, 2, 1, 128, False, 2),
                (1, 256, 256, 2, 1, 64, True, 3)]


@pytest.mark.parametrize("b,s,skv,h,kv,d,causal,chunks", KERNEL_CASES)
def test_kernel_matches_float32(b, s, skv, h, kv, d, causal, chunks):
  args, want = backward_problem(b, s, skv, h, kv, d, causal)
  blocks = BackwardBlocks(query_chunks=chunks)
  got = jax.jit(lambda *a: attention_backward_ws(*a, causal=causal, blocks=blocks, interpret=True))(*args)
  for name, g, w, dtype in zip(("dq", "dk", "dv"), got, want, (jnp.float32, jnp.bfloat16, jnp.bfloat16)):
    assert g.shape == w.shape and g.dtype == dtype
    err = rel_err(g, w)
    assert err < GRAD_TOL, f"{name}: rel err {err:.3e}"


def test_the_auto_chunks_go_by_the_length_and_the_mask():
  """Without a mask chunks of at most 32K queries; under a causal mask none."""
  assert [auto_chunks(s, False) for s in (4096, 32768, 32832, 65536, 131072)] == [1, 1, 2, 2, 4]
  assert [auto_chunks(s, True) for s in (16384, 32768, 65536, 131072)] == [1, 1, 1, 1]


def test_the_sums_go_by_the_chunks_and_the_group():
  """dk and dv are summed where the queries go in chunks or a K/V head has several query heads (an item each)."""
  assert BackwardBlocks().chunks(65536, True) == 1 and BackwardBlocks(query_chunks=2).chunks(65536, True) == 2
  assert BackwardBlocks().chunks(65536, False) == 2
  assert BackwardBlocks().summed(16384, True, 4) and not BackwardBlocks().summed(16384, True, 1)
  assert BackwardBlocks(query_chunks=2).summed(16384, True, 1)


@pytest.mark.parametrize("s,kv,causal,summed", [(65536, 8, False, True), (32768, 8, False, False),
                                                 (32768, 2, False, True), (65536, 8, True, False),
                                                 (16384, 2, True, True)])
def test_the_backward_workspace_counts_the_sums(s, kv, causal, summed):
  """Where the queries go in chunks (by the length and the mask) or a K/V head's query heads over several items
  (grouped K/V), the backward's workspace holds float32 dk and dv sums beside dq's."""
  dq_kernel = registry.local("ws_attention").backward.dq
  program = ab.attention_dq(jm.programs.attention(1, 8, kv, s, s, 128, causal=causal, dtype=jnp.bfloat16))
  sizes = dict(b=1, i=s, j=s, hk=kv, g=8 // kv, d=128)
  whole = 2 * 4 * s * 8 * 128 + 2 * 4 * s * 8  # dq and its copy, delta and lse rows
  sums = 2 * 4 * s * kv * 128
  assert dq_kernel.workspace_bytes(program, sizes) == whole + (sums if summed else 0)


def test_rows_without_keys_have_no_gradient():
  """A query row whose log-sum-exp is -inf kept no key: its dq is zero and it adds nothing to dk and dv."""
  (q, k, v, o, do, lse), _ = backward_problem(1, 128, 128, 2, 1, 64, False)
  lse = lse.at[:, :, 5].set(-jnp.inf)
  dq, dk, dv = jax.jit(lambda *a: attention_backward_ws(*a, interpret=True))(q, k, v, o, do, lse)
  assert not np.any(np.asarray(dq[:, 5]))
  kept = jnp.ones(128, bool).at[5].set(False)
  _, vjp = jax.vjp(lambda k, v: grouped_reference(q[:, kept].astype(jnp.float32), k, v, False), k.astype(jnp.float32),
                   v.astype(jnp.float32))
  want_dk, want_dv = vjp((do[:, kept].astype(jnp.float32), jnp.zeros((1, 2, 127))))
  assert rel_err(dk, want_dk) < GRAD_TOL and rel_err(dv, want_dv) < GRAD_TOL


@pytest.mark.parametrize("change,message", [
    (dict(d=96), "head dimension 96 must be 64 or 128"),
    (dict(dtype=jnp.float32), "must all be bfloat16 or all float16"),
    (dict(skv=256, causal=True), "causal takes queries and keys at the same positions"),
    (dict(s=160), "s_q=160 must be a multiple of block_q=64 and s_kv=128 of 2 \\* block_kv = 128"),
    (dict(lse=(1, 2, 64)), "lse must be \\[b, h, s_q\\]"),
    (dict(block_q=128), "block_q=128 and block_kv=64 must be 64"),
    (dict(max_concurrent_steps=1), "max_concurrent_steps=1 must be at least 2"),
    (dict(query_chunks=0), "query_chunks=0 must be None \\(auto_chunks\\) or a positive int"),
    (dict(query_chunks=3), "query_chunks=3 is more than the 2 query tiles of 64 rows")])
def test_bad_inputs_are_named(change, message):
  fields = {f.name for f in dataclasses.fields(BackwardBlocks)}
  p = dict(s=128, skv=128, d=64, dtype=jnp.bfloat16, causal=False, lse=None) | change
  blocks = BackwardBlocks(**{name: value for name, value in p.items() if name in fields})
  s = jax.ShapeDtypeStruct
  q = s((1, p["s"], 2, p["d"]), p["dtype"])
  k = s((1, p["skv"], 1, p["d"]), p["dtype"])
  lse = s(p["lse"] or (1, 2, p["s"]), jnp.float32)
  with pytest.raises(PreconditionError, match=message):
    jax.eval_shape(functools.partial(attention_backward_ws, causal=p["causal"], blocks=blocks, interpret=True),
                   q, k, k, q, q, lse)


# Pairwise: each head dimension with and without a mask, grouped K/V (summed) and MHA (stored), and the queries in
# chunks (summed) without a mask.
@pytest.mark.parametrize("d,causal,kv,chunks", [(64, True, 2, None), (128, False, 2, None), (64, False, 8, None),
                                                (128, True, 8, None), (128, False, 8, 3)])
def test_lowers_for_hopper(d, causal, kv, chunks):
  """Mosaic GPU's own passes (layouts, barriers, shared memory) accept the kernel for an H100: one kernel."""
  s = jax.ShapeDtypeStruct
  q, k, lse = s((1, 512, 8, d), jnp.bfloat16), s((1, 512, kv, d), jnp.bfloat16), s((1, 8, 512), jnp.float32)
  run = functools.partial(attention_backward_ws, causal=causal, blocks=BackwardBlocks(query_chunks=chunks))
  text = lower_for_gpus(run, q, k, k, q, q, lse, mesh=h100_mesh(1))
  assert mosaic_kernels(text) == 1


# ------------------------------------------------------------------ ws_attention's blocks at ring offsets


def _blocks(n, causal_lse=False):
  """Fresh bf16 blocks q [1, n, 2, 2, 64], k, v [1, n, 2, 64], o, do, and a consistent lse."""
  keys = jax.random.split(fresh_key(), 5)
  q = jax.random.normal(keys[0], (1, n, 2, 2, 64)).astype(jnp.bfloat16)
  k, v = (jax.random.normal(x, (1, n, 2, 64)).astype(jnp.bfloat16) for x in keys[1:3])
  o, do = (jax.random.normal(x, q.shape).astype(jnp.bfloat16) for x in keys[3:])
  sizes = {"i": n, "j": n}
  lse = jm.programs.attention(1, 4, 2, n, n, 64).body(jm.BlockContext({}, sizes, sizes), q, k, v)[1]
  return q, k, v, o, do, lse


# (query start, key start) of a 128-position block in a 512-position ring: visible, diagonal, hidden
STARTS = [(256, 0), (128, 128), (0, 256)]


def _ctx(starts, extents=512):
  return jm.BlockContext({"i": starts[0], "j": starts[1]}, {"i": 128, "j": 128}, {"i": extents, "j": extents})


def test_forward_blocks_by_position():
  q, k, v, *_ = _blocks(128)
  config = ws_attention.WsConfig()

  @jax.jit
  def both(starts, q, k, v):
    body = jm.programs.attention(1, 4, 2, 512, 512, 64, causal=True).body
    got = ws_attention.ws_attention_block(_ctx(starts), q, k, v, causal=True, config=config, interpret=True,
                                          fallback=body)
    return got, body(_ctx(starts), q, k, v)

  for at in STARTS:
    (out, lse), (want_out, want_lse) = both(jnp.array(at, jnp.int32), q, k, v)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert (rel_err(out, want_out) < 1e-2) if np.any(want_out) else not np.any(out)


@pytest.mark.parametrize("extents", [512, 500])  # 500: keys past the end are padding, which the body computes
def test_backward_blocks_by_position(extents):
  xs = _blocks(128)

  @jax.jit
  def both(starts, *xs):
    ctx = _ctx(starts, extents)
    got = ws_attention.ws_backward_block(ctx, *xs, causal=True, part="dq_dkv", interpret=True,
                                         fallback=functools.partial(ab.dq_dkv_block, causal=True))
    return got, ab.dq_dkv_block(ctx, *xs, causal=True)

  for at in STARTS:
    got, want = both(jnp.array(at, jnp.int32), *xs)
    for g, w in zip(got, want):
      assert g.shape == w.shape and g.dtype == jnp.float32
      assert (rel_err(g, w) < GRAD_TOL) if np.any(w) else not np.any(g)


# ------------------------------------------------------------------ in schedules


def _one_device(axis_type):
  return jax.make_mesh((1,), ("x",), axis_types=(axis_type,), devices=jax.devices()[:1])


@pytest.mark.parametrize("causal,axis_type,inside,chunks", [(True, AxisType.Explicit, True, 2),
                                                          (False, AxisType.Auto, False, 1)])
def test_local_schedule_trains_on_our_kernels(causal, axis_type, inside, chunks, monkeypatch):
  """One device: our forward, and our backward as one call for the device's whole attention (``whole``), on
  Explicit axes inside ``jax.set_mesh`` with the backward's automatic chunks set to 2 at this length (chunks of 128
  queries, dk and dv summed across them), and on Auto axes outside with the queries whole."""
  monkeypatch.setattr(ws_backward, "auto_chunks", lambda s_q, causal: chunks)
  assert BackwardBlocks().chunks(256, causal) == chunks
  planned = []  # the chunk counts the kernel was traced with
  plan = ws_backward.chunk_plan
  monkeypatch.setattr(ws_backward, "chunk_plan", lambda nq, n, *a: planned.append(n) or plan(nq, n, *a))
  mesh = _one_device(axis_type)
  prog = jm.programs.attention(1, 2, 1, 256, 256, 64, causal=causal, dtype=jnp.bfloat16)
  with registry.interpret_mode(), (jax.set_mesh(mesh) if inside else contextlib.nullcontext()):
    s = jm.Schedule(prog, mesh).patch("ws_attention")
    assert dual.backward_schedule(s).kernel == "ws_attention"  # an own backward: not cuDNN's
    _check_grads(s)
  assert planned and set(planned) == {chunks}


def test_fused_ring_attention_with_our_backward():
  mesh = _one_device(AxisType.Explicit)
  prog = jm.programs.attention(1, 2, 1, 256, 256, 64, causal=True, dtype=jnp.bfloat16)
  with registry.interpret_mode():
    ring = jm.library(prog, mesh)["ring"]
    s = ring.copy().lower_with("fused_ring_attention_ws", backward="ws_attention")
    assert dual.fused_loop_nest(s).kernel == "ws_attention"
    assert dual.fused_loop_nest(ring.copy().lower_with("fused_ring_attention_ws")).kernel is None
    assert "fused_ring_attention_ws(backward=ws_attention)" in str(s) and "on ws_attention's backward blocks" in str(s)
    _check_grads(s)
    with pytest.raises(PreconditionError, match=r"backward='cudnn' is not one of \[None, 'ws_attention'\]"):
      ring.lower_with("fused_ring_attention_ws", backward="cudnn")
    wide = jm.programs.attention(1, 4, 2, 256, 256, 192, causal=True, dtype=jnp.bfloat16)  # the forward takes it
    with pytest.raises(PreconditionError, match="backward='ws_attention': head dimension 192 must be 64 or 128"):
      jm.library(wide, mesh)["ring"].lower_with("fused_ring_attention_ws", block_kv=64, backward="ws_attention")


def test_own_backward_is_kept_where_cudnn_would_run():
  """On GPUs a schedule's backward runs cuDNN's blocks, unless its kernel's backward is its own (ours)."""
  prog = jm.programs.attention(1, 8, 2, 4096, 4096, 128, causal=True, dtype=jnp.bfloat16)
  gpus = h100_mesh(8)
  ring = jm.library(prog, gpus)["ring"]
  assert dual.backward_schedule(ring.copy().patch("mosaic_attention")).kernel == "cudnn_attention"
  assert dual.backward_schedule(ring.copy().patch("ws_attention")).kernel == "ws_attention"
  _, dq, dkv = dual.attention_duals(ring.copy().patch("ws_attention"), joint=True)
  assert (dq.kernel, dkv.kernel) == ("ws_attention_dq", "ws_attention_dkv")


def test_offered_on_gpus_unless_unverified(monkeypatch):
  """The tuner tries our kernels on GPUs (their GPU run passed); a kernel marked unverified it leaves out there,
  and interpret mode still tries it."""
  prog = jm.programs.attention(1, 4, 2, 256, 256, 64, causal=True, dtype=jnp.bfloat16)
  assert ws_attention.WS_ATTENTION.unverified is None
  assert {"ws_attention", "cudnn_attention"} <= set(registry.candidates(prog, h100_mesh(1)))
  monkeypatch.setitem(registry._KERNELS, "ws_attention",
                      dataclasses.replace(ws_attention.WS_ATTENTION, unverified="not yet run on a GPU"))
  assert "ws_attention" not in registry.candidates(prog, h100_mesh(1))
  assert "cudnn_attention" in registry.candidates(prog, h100_mesh(1))
  mesh = _one_device(AxisType.Explicit)
  with registry.interpret_mode():
    assert "ws_attention" in registry.candidates(prog, mesh)
    lowered = lambda training: [c.schedule.lowering_config for c in autotuner.default_candidates(
        prog, mesh, training=training) if c.schedule.lowering == "fused_ring_attention_ws"]
    with_ours = [c.backward for c in lowered(True)]
    assert with_ours.count("ws_attention") == with_ours.count(None) > 0  # each strategy both ways
    assert {c.backward for c in lowered(False)} == {None}


# ------------------------------------------------------------------ a ring of 8 devices, kernels stood in by XLA


def _at_origin(q, k):
  """A block context whose queries and keys both start at 0: the programs' own blocks, causal top-left."""
  sizes = {"i": q.shape[1], "j": k.shape[1]}
  return jm.BlockContext({"i": 0, "j": 0}, sizes, sizes)


def _standin_forward(q, k, v, *, causal, config, interpret, calls):
  """``ws_attention.forward``'s contract in XLA: the attention program's own block."""
  del config, interpret
  calls["forward"] += 1
  return attention_block(_at_origin(q, k), q, k, v, causal=causal)


def _standin_backward(q, k, v, o, do, lse, *, causal, interpret, calls):
  """``ws_attention.backward``'s contract in XLA, from the merged output and log-sum-exp: the joint dq and dk-dv
  block of the backward programs."""
  del interpret
  calls["backward"] += 1
  dq, dkv = ab.dq_dkv_block(_at_origin(q, k), q, k, v, o, do, lse, causal=causal)
  return dq, dkv[:, :, :, 0], dkv[:, :, :, 1]


def test_ring_of_eight_with_standins(monkeypatch):
  """The ring's joint backward runs one of our blocks per block pair, its dk-dv partials travelling the ring home."""
  calls = {"forward": 0, "backward": 0}
  monkeypatch.setattr(ws_attention, "forward", functools.partial(_standin_forward, calls=calls))
  monkeypatch.setattr(ws_attention, "backward", functools.partial(_standin_backward, calls=calls))
  for name in ("ws_attention", "ws_attention_dq", "ws_attention_dkv"):  # the interpreter's one-device limit
    monkeypatch.setitem(registry._KERNELS, name, dataclasses.replace(registry.local(name), interpret_devices=None))
  prog = jm.programs.attention(1, 4, 2, 1024, 1024, 64, causal=True, dtype=jnp.bfloat16)
  with registry.interpret_mode():
    s = jm.library(prog, make_mesh("8", AxisType.Explicit))["ring"].patch("ws_attention")
    _check_grads(s)
  assert calls["forward"] and calls["backward"]
