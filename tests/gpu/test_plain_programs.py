"""The plain programs in the caller's layouts on JAX's default (Explicit) mesh axes over every local GPU, checked
and timed as a tune does; the untuned FSDP-style block compiles to the plain block's collectives (skipped on CPU)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.analysis.hlo import compiled_collectives
from jaxmercury.tuner import measure
from jaxmercury.tuner.plain import plain_programs
from jaxmercury.tuner.reference import trial

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")


def _explicit_mesh():
  return jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(AxisType.Explicit,))


def _measured(plain, training: bool):
  inputs, cot, reference = trial(plain.program, int(jax.random.randint(fresh_key(), (), 0, 2 ** 30)),
                                 jax.devices()[0], training=training)
  return measure.measure(plain, inputs, reference, iters=2, cotangent=cot)


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_tensor_parallel_gemms(training):
  """``x[M@x, K] . w[K, N@x]`` and ``x[M, K@x] . w[K@x, N]``: ``jnp.dot`` with ``out_sharding`` (they raised
  ShardingTypeError without it)."""
  mesh = _explicit_mesh()
  prog = jm.programs.matmul(4096, 4096, 4096, dtype=jnp.bfloat16)
  rows, cols = P("x", None), P(None, "x")
  for ins, out in (((rows, cols), rows), ((cols, rows), rows)):
    (plain,) = plain_programs(prog, mesh, ins, out)
    result = _measured(plain, training)
    assert result.status == measure.OK, (ins, result.reason)


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_xla_attention_split_by_sequence(training):
  """JAX's XLA attention (float32: cuDNN's takes half precision) on sequence-split q, k and v, which JAX's types
  refuse: called with the axes made Auto."""
  mesh = _explicit_mesh()
  n = len(jax.devices())
  prog = jm.programs.attention(1, 4 * n, n, 512 * n, 512 * n, 64, causal=True)
  seq = P(None, "x", None, None)
  (plain,) = plain_programs(prog, mesh, (seq,) * 3, seq)
  assert plain.plain.implementation == "xla"
  result = _measured(plain, training)
  assert result.status == measure.OK, result.reason


def test_untuned_fsdp_block_has_the_plain_blocks_collectives(tmp_path):
  from test_untuned import FsdpBlock  # the CPU test's block (a test module, imported where it is used)
  mesh = _explicit_mesh()
  db = jm.Database(str(tmp_path / "t.db"))
  with jax.set_mesh(mesh):
    texts = []
    for block in (FsdpBlock(mesh, rngs=nnx.Rngs(0)),
                  jm.distribute(FsdpBlock(mesh, rngs=nnx.Rngs(0)), mesh=mesh, database=db)):
      graphdef, state = nnx.split(block)
      x = jax.device_put(jax.random.normal(fresh_key(), (8, 1024, 128)), NamedSharding(mesh, P("x")))
      loss = lambda state, x, graphdef=graphdef: jnp.mean(nnx.merge(graphdef, state)(x) ** 2)
      texts.append(jax.jit(jax.value_and_grad(loss)).lower(state, x).compile().as_text())
  plain, routed = (compiled_collectives(t) for t in texts)
  assert all(n <= plain.get(kind, 0) for kind, n in routed.items()), (routed, plain)


@pytest.mark.parametrize("mask", ["segment_ids", "mask"])
def test_cudnn_attention_with_a_data_mask_split_by_sequence(mask):
  """cuDNN's attention with segment ids or a mask array as one dense boolean mask (what a user passes), bf16,
  sequence-split callers: the plain program a packed call runs untuned, forward and training step."""
  mesh = _explicit_mesh()
  n = len(jax.devices())
  prog = jm.programs.attention(1, 4 * n, n, 1024 * n, 1024 * n, 64, causal=True, dtype=jnp.bfloat16, **{mask: True})
  seq = P(None, "x", None, None)
  extras = (P(None, "x"),) * 2 if mask == "segment_ids" else (P(None, "x", None),)
  plains = plain_programs(prog, mesh, (seq,) * 3 + extras, seq)
  assert plains[0].plain.implementation == "cudnn"
  for training in (False, True):
    result = _measured(plains[0], training)
    assert result.status == measure.OK, (training, result.reason)
