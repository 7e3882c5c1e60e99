"""Our one-pass attention backward kernel and ``ws_attention`` on a real GPU (skipped on CPU).

The kernel (``attention_backward_ws``) against the float32 derivative of plain attention and against cuDNN's
flash backward from the same output and log-sum-exp; the ``ws_attention`` local kernel trained on one GPU and the
fused ring attention configured with ``backward="ws_attention"`` on every GPU against the float32 reference.

Run: ``JAX_PLATFORMS=cuda timeout 300 python3 -m pytest tests/gpu/test_ws_attention.py -x -q`` (the timeout: a
barrier protocol that deadlocks hangs rather than fails).
"""

import jax
import jax.numpy as jnp
import pytest
from conftest import rel_err
from jax.sharding import AxisType
from ring_attention_checks import backward_problem

import jaxmercury as jm
from gpu.checks import check_gradients, check_schedule
from jaxmercury.kernels.attention.cudnn import cudnn_backward
from jaxmercury.kernels.attention.ws_backward import BackwardBlocks, attention_backward_ws

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs GPUs")

GRAD_TOL = 3e-2


@pytest.mark.parametrize("b,s,skv,h,kv,d,causal,chunks", [
    (1, 1024, 1024, 4, 4, 128, False, None), (1, 1024, 1024, 8, 2, 128, True, None), (2, 512, 512, 4, 1, 64, True, None),
    (1, 2048, 2048, 4, 2, 64, False, None), (1, 512, 1536, 4, 2, 128, False, None),
    (1, 4096, 4096, 8, 2, 128, True, None), (1, 4096, 4096, 32, 8, 128, False, None),
    (1, 4096, 4096, 32, 32, 128, False, 2), (1, 4096, 4096, 8, 2, 128, True, 3), (2, 512, 512, 4, 1, 64, False, 5)])
def test_kernel_matches_float32(b, s, skv, h, kv, d, causal, chunks):
  """MHA, GQA and MQA, head dims 64 and 128, causal and not, more keys than queries, the queries whole and in
  chunks (dk and dv added across them)."""
  args, want = backward_problem(b, s, skv, h, kv, d, causal)
  blocks = BackwardBlocks(query_chunks=chunks)
  got = jax.jit(lambda *a: attention_backward_ws(*a, causal=causal, blocks=blocks))(*args)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.shape == w.shape
    err = rel_err(g.astype(jnp.float32), w)
    assert err < GRAD_TOL, f"{name}: rel err {err:.3e}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_matches_cudnn(causal, dtype):
  """The same gradients as cuDNN's flash backward from the same output and log-sum-exp."""
  (q, k, v, o, do, lse), _ = backward_problem(1, 2048, 2048, 8, 2, 128, causal, dtype)
  ours = jax.jit(lambda *a: attention_backward_ws(*a, causal=causal))(q, k, v, o, do, lse)
  theirs = jax.jit(lambda *a: cudnn_backward(*a, causal))(q, k, v, o, do, jnp.transpose(lse, (0, 2, 1)))
  for name, g, w in zip(("dq", "dk", "dv"), ours, theirs):
    err = rel_err(g.astype(jnp.float32), w.astype(jnp.float32))
    assert err < GRAD_TOL, f"{name}: rel err {err:.3e} against cuDNN"


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("causal", [False, True])
def test_ws_attention_trains(causal, axis_type):
  """A one-GPU schedule patched with ws_attention: our forward and our backward, against the float32 reference."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(axis_type,))
  prog = jm.programs.attention(1, 8, 2, 2048, 2048, 128, causal=causal, dtype=jnp.bfloat16)
  schedule = jm.Schedule(prog, mesh).patch("ws_attention")
  check_schedule(schedule)
  check_gradients(schedule)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_ring_attention_with_our_backward(causal):
  """The fused ring attention over every GPU configured with backward="ws_attention": one kernel family end to end
  (on several GPUs the ring passes our backward blocks' dk-dv partials)."""
  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ("x",))  # Explicit axes, as users get them
  prog = jm.programs.attention(1, 8, 2, 2048 * n, 2048 * n, 128, causal=causal, dtype=jnp.bfloat16)
  schedule = jm.library(prog, mesh)["ring"].lower_with("fused_ring_attention_ws", backward="ws_attention")
  check_gradients(schedule)
