"""Packed sequences and masks that skip what they hide: tuning masked attention, rings that skip steps by the
segment ids, the balanced split, and routing packed models.

Shapes are tiny and candidate sets small: each test runs in seconds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, make_mesh, rel_err
from flax import nnx
from jax.sharding import AxisType

import jaxmercury as jm
from jaxmercury.analysis import placements
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


def dense(q, k, v, keep):
  """Attention with ``keep`` [b or 1, h or 1, t, s]; rows that keep nothing give zeros."""
  h, hk = q.shape[2], k.shape[2]
  k, v = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  s = jnp.where(keep, s, -jnp.inf)
  top = jnp.max(s, -1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
  p = p / jnp.maximum(jnp.sum(p, -1, keepdims=True), 1e-30)
  return jnp.einsum("bhts,bshd->bthd", p, v)


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
    assert (e.routed, e.mask, e.reason) == (True, "causal+segment_ids", "tuned")
    assert rel_err(routed(x, seg), model(x, seg)) < 1e-5
