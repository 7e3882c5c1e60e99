"""Packed sequences and masks that skip what they hide: tuning masked attention, rings that skip steps by the
segment ids, the balanced split, and routing packed models.

Shapes are tiny and candidate sets small: each test runs in seconds.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  adam_losses,
  assert_trains_alike,
  fresh_key,
  make_mesh,
  rel_err,
  run_processes,
  store_library_winners,
)
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from test_masks import dense

import jaxmercury as jm
from jaxmercury.analysis import placements
from jaxmercury.analysis.packed import sample_run
from jaxmercury.kernels import registry
from jaxmercury.tuner import autotuner, cost

CPU = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
TUNE = dict(space=0, top_k=0, iters=2, machine=CPU, log=lambda line: None)


def packing(rng, batch, length, *, shortest=1, longest=None):
  """Segment ids [batch, length] of rows packed with documents of random lengths in [shortest, longest]."""
  longest = longest or length
  ids = np.zeros((batch, length), np.int32)
  for row in ids:
    at, doc = 0, 0
    while at < length:
      n = int(rng.integers(shortest, longest + 1))
      row[at:at + n] = doc
      at, doc = at + n, doc + 1
  return ids


# ------------------------------------------------------------------ tuning masked attention
MASKS = {"segment_ids": dict(causal=True, segment_ids=True), "mask": dict(mask=True),
         "window": dict(causal=True, window=(3, 0))}


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_masked_attention_has_tuning_candidates(mask, devices):
  """The tuner's candidates of masked attention (where tuning failed: the fused ring attentions' placement read
  the program's buffers as q, k, v); the fused kernels say why they do not apply."""
  mesh = make_mesh("8") if devices == 8 else jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))
  prog = jm.programs.attention(1, 4, 2, 64, 64, 64, dtype=jnp.bfloat16, **MASKS[mask])
  assert autotuner.default_candidates(prog, mesh, space=2)
  ring = jm.library(prog, mesh)["ring"]
  for k in registry.fused_kernels():
    if k.placement == "ring_attention":
      assert f"not by the program's ['{mask}']" in placements.why_not(k, ring)


def test_autotune_masked_attention_on_the_mesh():
  """Segment ids, a mask array and a window together, tuned on the 8-device mesh: the winner is checked against
  the reference by the tuner and runs."""
  mesh = make_mesh("8")
  prog = jm.programs.attention(1, 4, 2, 32, 32, 8, causal=True, window=(9, 0), segment_ids=True, mask=True)
  lib = jm.library(prog, mesh)
  result = jm.autotune(prog, mesh, candidates=[(n, lib[n]) for n in ("ring", "tree")], key=fresh_key(), **TUNE)
  assert result.best is not None and not [c for c in result.candidates if c.status == "failed"]
  xs = prog.random_inputs(fresh_key())
  assert rel_err(result.best.schedule.compile()(*xs), prog.reference(*xs)) < 1e-5


def test_ops_attention_tunes_masked_attention_on_one_device(tmp_path):
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
  key = iter(jax.random.split(fresh_key(), 4))
  q = jax.random.normal(next(key), (2, 32, 4, 8))
  k, v = (jax.random.normal(next(key), (2, 32, 2, 8)) for _ in range(2))
  seg = jnp.asarray(packing(np.random.default_rng(), 2, 32, longest=12))
  mask = jax.random.bernoulli(next(key), 0.8, (2, 32, 32))
  with jax.set_mesh(mesh):
    y = jm.ops.attention(q, k, v, mesh=mesh, causal=True, window=(5, 0), q_segment_ids=seg, kv_segment_ids=seg,
                         mask=mask, mask_axes=("b", "i", "j"), tune=True, database=jm.Database(str(tmp_path / "db")),
                         **TUNE)
  d = np.arange(32)[:, None] - np.arange(32)[None, :]
  keep = (d >= 0) & (d <= 5) & (seg[:, None, :, None] == seg[:, None, None, :]) & mask[:, None]
  assert rel_err(y, dense(q, k, v, keep)) < 1e-5


class Packed(nnx.Module):
  """MaxText's packed attention: segment ids compared with ``==`` into the mask of
  ``jax.nn.dot_product_attention``, causal."""

  def __init__(self, rngs):
    self.qkv = nnx.Einsum("BTD,SDNH->SBTNH", (3, 16, 4, 8), rngs=rngs)

  def __call__(self, x, segment_ids):
    q, k, v = self.qkv(x)
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True)


def test_distribute_tunes_a_packed_model(tmp_path):
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
  model = Packed(nnx.Rngs(0))
  x = jax.random.normal(fresh_key(), (2, 32, 16))
  seg = jnp.asarray(packing(np.random.default_rng(), 2, 32, longest=12))
  db = jm.Database(str(tmp_path / "db"))
  db.store_machine(jm.programs.attention(2, 4, 4, 32, 32, 8, causal=True, segment_ids=True), mesh, CPU)
  options = {k: v for k, v in TUNE.items() if k != "machine"}  # a Machine is not hashable: given by the database
  routed = jm.distribute(model, mesh=mesh, tune=True, database=db, linear=False, **options)
  with jax.set_mesh(mesh):
    [e] = [e for e in jm.explain(routed, x, seg) if e.kind == "attention"]
    assert e.mask == "causal+segment_ids" and e.reason in ("tuned", "plain (tuned: no schedule beat it)"), e
    assert rel_err(routed(x, seg), model(x, seg)) < 1e-5


# ------------------------------------------------------------------ rings that skip steps by the segment ids
def ring_steps_with_pairs(seg, devices, causal=True):
  """The steps t of a natural-order ring (rank r visits key block (t + r) % devices) at which some rank's queries
  keep a key: from the dense mask."""
  t = seg.shape[1]
  d = np.arange(t)[:, None] - np.arange(t)[None, :]
  keep = (seg[:, :, None] == seg[:, None, :]) & ((d >= 0) if causal else True)
  share = t // devices
  return {s for s in range(devices) for r in range(devices)
          if keep[:, r * share:(r + 1) * share, ((r + s) % devices) * share:((r + s) % devices + 1) * share].any()}


def check_packed(schedules, xs, keep, *, grads=True, tol=2e-5):
  """Each schedule's output and the gradients of a weighted sum of it against ``dense`` with ``keep``."""
  host = [jax.device_get(x) for x in xs]
  want = dense(*host[:3], keep)
  w = jax.random.normal(fresh_key(), want.shape)
  want_g = jax.grad(lambda q, k, v: jnp.sum(w * dense(q, k, v, keep)), argnums=(0, 1, 2))(*host[:3])
  for name, s in schedules.items():
    f = s.compile()
    assert rel_err(f(*xs), want) < tol, f"{name}\n{s}"
    if grads:
      g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(w * f(q, k, v, *xs[3:])), argnums=(0, 1, 2)))(*xs[:3])
      for part, a, b in zip("qkv", g, want_g):
        assert rel_err(a, b) < 10 * tol, f"d{part} {name}\n{s}"


@pytest.fixture
def prefixes(monkeypatch):
  """The numbers of chain steps the data-decided rings run, recorded while running."""
  from jaxmercury.lowering import nest
  ran, decide = [], nest.Nest._data_prefix

  def recorded(self, *args):
    runs = decide(self, *args)
    jax.debug.callback(lambda r: ran.append(int(r)), runs)
    return runs
  monkeypatch.setattr(nest.Nest, "_data_prefix", recorded)
  return ran


def devices(n, axis_type=AxisType.Auto):
  """A one-level mesh ``("x",)`` of the first ``n`` devices."""
  return jax.make_mesh((n,), ("x",), axis_types=(axis_type,), devices=jax.devices()[:n])


def test_ring_prints_the_steps_that_keep_pairs():
  """Random packings (documents shorter than a device's 8 queries, and most of a row): the printout's steps are
  the steps with kept pairs, in the order the ring takes them (the previous rank's keys first)."""
  ring = jm.library(jm.programs.attention(3, 4, 2, 64, 64, 8, causal=True, segment_ids=True), make_mesh("8"))["ring"]
  seg = packing(np.random.default_rng(), 3, 64, shortest=2, longest=24)
  seg[1, :3], seg[1, 3:] = 0, 1  # one document of most of the row
  want = ring_steps_with_pairs(seg, 8)
  run = ring.data_run(seg, seg)
  assert set(run.kept_steps["j0"]) == want and run.steps["j0"] == (0, 7, 6, 5, 4, 3, 2, 1)[:len(want)]
  assert f"pairs kept at {len(want)} of 8 steps, runs {len(want)} " in ring.describe(seg, seg)
  short = np.arange(64)[None].repeat(3, 0) // 4  # documents of half a device's share
  assert ring.data_run(short, short).steps["j0"] == (0,)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_ring_runs_the_steps_that_keep_pairs(axis_type, prefixes):
  """On four devices: the ring runs as many steps as ``data_run`` counts, forward and backward, on every device;
  the output and gradients are right."""
  mesh = devices(4, axis_type)
  t = 32
  prog = jm.programs.attention(2, 4, 2, t, t, 8, causal=True, segment_ids=True)
  ring = jm.library(prog, mesh)["ring"]
  seg = packing(np.random.default_rng(), 2, t, shortest=1, longest=12)
  want = len(ring.data_run(seg, seg).steps["j0"])
  assert len(ring_steps_with_pairs(seg, 4)) == want
  q, k, v = prog.random_inputs(fresh_key())[:3]
  d = np.arange(t)[:, None] - np.arange(t)[None, :]
  keep = (seg[:, None, :, None] == seg[:, None, None, :]) & (d >= 0)
  with jax.set_mesh(mesh):
    check_packed({"ring": ring}, (q, k, v, jnp.asarray(seg), jnp.asarray(seg)), keep)
  assert set(prefixes) == {want}


def long_tailed(rng, batch, length):
  """Rows of one document of half the row among documents of random lengths (up to an eighth of it)."""
  ids = packing(rng, batch, length, shortest=1, longest=length // 8)
  start = int(rng.integers(0, length // 2))
  ids[:, start:start + length // 2] = ids.max() + 1
  return ids


def test_a_ring_of_queries_skips_by_the_segment_ids_too():
  """Keys stay, queries and their ids travel, partial outputs travel home (a ring of ``i`` over a parallel ``j``,
  serial tiles inside): the steps run, the output and gradients."""
  mesh = devices(4)
  t = 32
  prog = jm.programs.attention(2, 4, 2, t, t, 8, causal=True, segment_ids=True)
  s = jm.Schedule(prog, mesh)
  s.tile("j", 4).parallelize("j0", "x")
  s.tile("i", 4).shift("i0", "j0")
  s.tile("i1", 2, names=("i_t", "i_b")).tile("j1", 2, names=("j_t", "j_b"))
  ring = s.plan().rings["i0"]
  assert ring.travel and "q_segment_ids" in ring.buffers and ring.chain_steps() == [3, 0, 1, 2]
  seg = packing(np.random.default_rng(), 2, t, longest=9)
  assert s.data_run(seg, seg).steps["i0"] in ((3,), (3, 0))  # documents of up to 9: the next device's at most
  q, k, v = prog.random_inputs(fresh_key())[:3]
  d = np.arange(t)[:, None] - np.arange(t)[None, :]
  keep = (seg[:, None, :, None] == seg[:, None, None, :]) & (d >= 0)
  check_packed({"ring of queries": s}, (q, k, v, jnp.asarray(seg), jnp.asarray(seg)), keep)


def test_ring_steps_follow_the_zigzag_order_too():
  """In zigzag order a rank's two chunks have neighbours on both sides: the chain alternates; the printout counts
  the steps with kept pairs."""
  mesh = make_mesh("8")
  prog = jm.programs.attention(1, 4, 2, 64, 64, 8, causal=True, segment_ids=True)
  zigzag = jm.library(prog, mesh)["ring_zigzag"]
  assert zigzag.plan().rings["j0"].chain_steps() == [0, 1, 7, 2, 6, 3, 5, 4]
  seg = np.arange(64)[None] // 4  # documents of a chunk: each rank's own blocks only
  assert zigzag.data_run(seg, seg).steps["j0"] == (0,)
  assert "runs 1 (0) of 0, 1, 7, 2, 6, 3, 5, 4" in zigzag.describe(seg, seg)


def test_cost_model_counts_what_runs_for_the_programs_sample():
  """The cost model prices packed attention on the program's own sample of ids (the packings a tune times): the
  busiest device's blocks that keep a pair, the ring's transfers of the steps that run."""
  mesh = AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))
  machine = cost.Machine("test", 100e12, {"*": 100e9}, 10e-6, call_overhead_s=0.0, memory_bytes_per_s=1e30)
  t = 8192
  plain = jm.library(jm.programs.attention(1, 8, 8, t, t, 64, causal=True), mesh)["ring"]
  packed = jm.library(jm.programs.attention(1, 8, 8, t, t, 64, causal=True, segment_ids=True), mesh)["ring"]
  run = sample_run(packed)
  steps = run.steps["j0"]  # documents of 128-2048 positions, 1024 a device: the previous two devices' keys at most
  assert steps in ((0, 7), (0, 7, 6))
  assert cost.compute_seconds(packed, machine) == pytest.approx(cost.compute_seconds(plain, machine) * max(run.calls) / 8)
  assert packed.plan().rings["j0"].moves(steps) == len(steps) - 1 and plain.plan().rings["j0"].transfers == 7
  assert cost.predict(packed, machine) < cost.predict(plain, machine) / 2


# ------------------------------------------------------------------ the balanced split
@pytest.mark.parametrize("rows", ["uniform", "long_tailed"])
def test_balanced_split_evens_the_kept_pairs(rows):
  """Random packings: documents of random lengths (1/64 to 1/4 of the row, as tunes draw them), and rows with one
  document of half the row: each device's kept pairs within 10% of the mean in the balanced split, where the
  plain split and zigzag order leave the busiest device far above it."""
  mesh = make_mesh("8")
  t = 2048
  prog = jm.programs.attention(4, 4, 2, t, t, 8, causal=True, segment_ids=True)
  lib = jm.library(prog, mesh)
  rng = np.random.default_rng()
  seg = (np.asarray(jm.programs.packing.random_packing(fresh_key(), 4, t)) if rows == "uniform"
         else long_tailed(rng, 4, t))
  pairs = {name: np.array(lib[name].data_run(seg, seg).pairs) for name in ("ring", "ring_zigzag", "ring_balanced")}
  assert len({int(p.sum()) for p in pairs.values()}) == 1  # the same work, placed differently
  balanced = pairs["ring_balanced"]
  assert np.abs(balanced / balanced.mean() - 1).max() < 0.1, balanced / balanced.mean()
  if rows == "long_tailed":
    assert all(p.max() > 1.3 * p.mean() for name, p in pairs.items() if name != "ring_balanced")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_balanced_ring_forward_and_backward(axis_type):
  """The balanced ring on two devices: random packings with documents shorter than a chunk and one longer than a
  device's share; the output (and on Explicit axes the gradients) against the dense reference, permuted back."""
  mesh = devices(2, axis_type)
  t = 32
  prog = jm.programs.attention(2, 4, 2, t, t, 8, causal=True, segment_ids=True)
  ring = jm.library(prog, mesh)["ring_balanced"]
  assert ring.balanced and "balanced order" in str(ring)
  assert jm.Schedule.from_json(prog, mesh, ring.to_json()).balanced
  seg = long_tailed(np.random.default_rng(), 2, t)
  q, k, v = prog.random_inputs(fresh_key())[:3]
  d = np.arange(t)[:, None] - np.arange(t)[None, :]
  keep = (seg[:, None, :, None] == seg[:, None, None, :]) & (d >= 0)
  with jax.set_mesh(mesh):  # gradients on Explicit axes, whose types the permutations must keep
    check_packed({"ring_balanced": ring}, (q, k, v, jnp.asarray(seg), jnp.asarray(seg)), keep,
                 grads=axis_type == AxisType.Explicit)


# ------------------------------------------------------------------ packed models reach these schedules
def flax_packed(q, k, v, seg):
  """Flax's packed attention: float masks from ``make_attention_mask(seg, seg, jnp.equal)`` and the causal mask,
  combined, into ``nnx.dot_product_attention``."""
  mask = nnx.combine_masks(nnx.make_attention_mask(seg, seg, pairwise_fn=jnp.equal), nnx.make_causal_mask(seg))
  return nnx.dot_product_attention(q, k, v, mask=mask)


def maxtext_packed(q, k, v, seg):
  """MaxText's: ``==`` of the ids, ``and`` the causal mask, the scores masked by ``where`` before the softmax."""
  t = seg.shape[1]
  mask = (seg[:, :, None] == seg[:, None, :]) & (jnp.arange(t)[:, None] >= jnp.arange(t)[None, :])[None]
  s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  s = jnp.where(mask[:, None], s, -0.7 * float(np.finfo(np.float32).max))
  return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("style", ["flax", "maxtext"])
def test_packed_attention_routes_and_trains(style, tmp_path):
  """Segment ids compared with ``==`` (Flax's float masks, MaxText's booleans) reach the schedules that skip by
  them; ``jm.explain`` says so; three optimizer steps train as the plain model does."""
  attend = {"flax": flax_packed, "maxtext": maxtext_packed}[style]
  mesh = devices(4, AxisType.Explicit)
  key = iter(jax.random.split(fresh_key(), 4))
  x = jax.random.normal(next(key), (2, 32, 16))
  params = {n: jax.random.normal(next(key), (16, 4, 8)) / 4 for n in "qkv"}
  seg = jnp.asarray(packing(np.random.default_rng(), 2, 32, longest=12))

  def loss(fn, p):
    q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[n]) for n in "qkv")
    return jnp.mean(jnp.sin(fn(q, k, v, seg)))

  def train(fn):
    return adam_losses(lambda p: loss(fn, p), params)

  db = jm.Database(str(tmp_path / "db"))
  routed = jm.distribute(attend, mesh=mesh, database=db)
  with jax.set_mesh(mesh):
    example = (*(jnp.zeros((2, 32, 4, 8)),) * 3, seg)
    assert store_library_winners(db, lambda: jm.explain(routed, *example)) == 1  # untuned: plain
    [e] = jm.explain(routed, *example)
    assert (e.routed, e.mask) == (True, "causal+segment_ids")
    assert e.schedule == "ring (skips ring steps and blocks by segment ids)"
    assert_trains_alike(train(routed), train(attend))


# ------------------------------------------------------------------ several processes
PROCESS = textwrap.dedent("""
    import json, os, sys
    pid, port = int(sys.argv[1]), sys.argv[2]
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jaxmercury as jm

    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    prog = jm.programs.attention(1, 2, 2, 16, 16, 8, causal=True, segment_ids=True)
    seg = np.zeros((1, 16), np.int32)
    seg[0, 6:10], seg[0, 10:] = 1, 2  # documents across the processes' devices: steps 0 and 3 run
    q, k, v = (np.asarray(x) for x in prog.random_inputs(jax.random.key(3))[:3])
    ref = np.asarray(prog.reference(q, k, v, seg, seg))
    ring = jm.library(prog, mesh)["ring"]
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "x")))
    with jax.set_mesh(mesh):
      y = ring.compile()(*map(put, (q, k, v, seg, seg)))
    err = max(float(np.max(np.abs(np.asarray(s.data) - ref[s.index]))) for s in y.addressable_shards)
    print("REPORT " + json.dumps({"err": err, "steps": list(ring.data_run(seg, seg).steps["j0"])}), flush=True)
    jax.distributed.shutdown()
""")


def test_the_ring_decides_its_steps_alike_on_two_processes():
  """Two processes of two CPU devices (gloo): the steps a ring runs are decided over the whole mesh, so both
  processes make the same collectives, and each one's shards of the output are right."""
  for report in run_processes(PROCESS, [[], []], devices=2):
    assert report["steps"] == [0, 3] and report["err"] < 1e-5, report
