"""cuDNN attention patched into distributed schedules, on real GPUs (skipped on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jaxmercury as jm

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")


def _mesh():
  n = len(jax.devices())
  return jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,))


def _check(schedule, tol=2e-2):
  prog = schedule.program
  xs = prog.random_inputs(jax.random.key(np.random.randint(1 << 30)))
  ref_prog = jm.programs.attention(**{**prog.params, "dtype": jnp.float32})
  ref = ref_prog.reference(*[x.astype(jnp.float32) for x in xs])
  y = schedule.compile()(*xs).astype(jnp.float32)
  err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
  assert err < tol, f"rel err {err}\n{schedule}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("strategy", ["ring", "context_parallel", "tree", "ulysses"])
def test_library_with_cudnn(strategy, causal):
  prog = jm.programs.attention(2, 8, 2, 1024, 1024, 128, causal=causal, dtype=jnp.bfloat16)
  lib = jm.library(prog, _mesh())
  if strategy not in lib:
    pytest.skip(f"{strategy} does not apply")
  _check(lib[strategy].patch("cudnn_attention"))


@pytest.mark.parametrize("causal", [False, True])
def test_ring_with_uneven_blocks_uses_all_paths(causal):
  """Tiling keys finer than queries exercises the visible, hidden and fallback branches."""
  prog = jm.programs.attention(1, 4, 4, 512, 512, 64, causal=causal, dtype=jnp.bfloat16)
  n = len(jax.devices())
  s = jm.Schedule(prog, _mesh()).tile("i", n).parallelize("i0", "x").tile("j", n).shift("j0", "i0")
  s.tile("j1", 2).patch("cudnn_attention")
  _check(s)


@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag", "context_parallel"])
def test_gradients_with_cudnn_backward(strategy):
  prog = jm.programs.attention(1, 8, 2, 2048, 2048, 128, causal=True, dtype=jnp.bfloat16)
  s = jm.library(prog, _mesh())[strategy].patch("cudnn_attention")
  xs = prog.random_inputs(jax.random.key(np.random.randint(1 << 30)))
  cot = jax.random.normal(jax.random.key(3), prog.writes.shape, jnp.float32)
  ref_prog = jm.programs.attention(**{**prog.params, "dtype": jnp.float32})
  want = jax.grad(lambda *a: jnp.sum(ref_prog.reference(*a) * cot), argnums=(0, 1, 2))(
      *[x.astype(jnp.float32) for x in xs])
  f = s.compile()
  got = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot), argnums=(0, 1, 2)))(*xs)
  for g, w in zip(got, want):
    err = float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
    assert err < 3e-2, f"{strategy}: rel err {err}"
