"""The cuDNN attention kernel's block dispatch, checked on CPU with cuDNN stood in by XLA.

On GPU the same dispatch calls cuDNN (tests/gpu); here (``conftest.cpu_cudnn``) each path's choice of
visible / hidden / diagonal / fallback is checked against the reference.
"""

import functools

import jax.numpy as jnp
import pytest
from conftest import assert_matches, make_mesh

import jaxmercury as jm
from jaxmercury.kernels.attention import cudnn as cudnn_attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", [1, 2], ids=["even-blocks", "uneven-blocks"])
def test_ring_dispatch(cpu_cudnn, causal, split):
  prog = jm.programs.attention(1, 4, 2, 64, 64, 8, causal=causal)
  s = jm.Schedule(prog, make_mesh("8")).tile("i", 8).parallelize("i0", "x").tile("j", 8).shift("j0", "i0")
  if split > 1:
    s.tile("j1", split)
  assert_matches(s.patch("cudnn_attention"))


def test_padded_keys_fall_back(cpu_cudnn):
  prog = jm.programs.attention(1, 4, 4, 30, 30, 8, causal=True)
  s = jm.library(prog, make_mesh("8"))["ring"].patch("cudnn_attention")
  assert_matches(s)


def test_hidden_block_is_skipped(cpu_cudnn):
  ctx = jm.BlockContext(starts={"i": 0, "j": 16}, sizes={"i": 8, "j": 8}, extents={"i": 32, "j": 32})
  q = jnp.ones((1, 8, 1, 1, 4))
  k = v = jnp.ones((1, 8, 1, 4))
  fallback = functools.partial(jm.programs.attention(1, 1, 1, 32, 32, 4, causal=True).body)
  out, lse = cudnn_attention.cudnn_attention_block(ctx, q, k, v, mask=jm.programs.AttentionMask(causal=True),
                                                   fallback=fallback)
  assert bool(jnp.all(out == 0)) and bool(jnp.all(jnp.isneginf(lse)))


@pytest.mark.parametrize("strategy", ["ring", "ring_zigzag", "context_parallel", "tree"])
def test_backward_dispatch_gradients(cpu_cudnn, strategy):
  """Patched cuDNN forward maps to the cuDNN backward kernels; gradients equal the reference's."""
  from test_training import _check_grads
  prog = jm.programs.attention(1, 4, 2, 64, 64, 8, causal=True)
  s = jm.library(prog, make_mesh("8"))[strategy].patch("cudnn_attention")
  from jaxmercury.schedules.dual import attention_duals
  _, dq, dkv = attention_duals(s)
  assert (dq.kernel, dkv.kernel) == ("cudnn_attention_dq", "cudnn_attention_dkv")
  _check_grads(s)
