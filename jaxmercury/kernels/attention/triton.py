"""A flash attention forward (with lse) written in Triton, called through jax-triton.

For GPUs of compute capability 8.0 and newer (A100, L4, H100, ...): plain
``tl.dot`` tiles, which Triton lowers to mma on Ampere/Ada and wgmma on
Hopper. Masks come from position vectors exactly as in ``flash_attention``
(``qpos``, ``kpos``, ``PAD_KEY`` for padding keys), so the kernel serves ring
steps at traced offsets, zigzag layouts and padded keys; key blocks that no
query of the tile can see are skipped.

``triton`` and ``jax_triton`` are imported only when the kernel is used;
without them the kernel reports why in ``supports`` and is never offered.
"""

from __future__ import annotations

import functools
import importlib
import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.kernels.attention.pallas import BACKWARD, PAD_KEY, PAD_QUERY, ForwardBlocks, positions
from jaxmercury.kernels.registry import Kernel


def _older_triton_compat():
  """Lets jax_triton 0.4 (written for triton 3.7) load triton 3.6's NVIDIA backend.

  jax_triton imports ``TMA_TF32`` from triton's NVIDIA driver module and, if
  that fails, replaces the whole backend by stubs. Triton 3.6 lacks only that
  name, which jax_triton uses for tf32-rounded TMA descriptors (not used here).
  """
  try:
    from triton.backends.nvidia import driver  # optional dependency: triton, GPUs only
  except ImportError:
    return
  if not hasattr(driver, "TMA_TF32"):
    driver.TMA_TF32 = 0


@functools.cache
def _import_error() -> str | None:
  """Why triton or jax_triton cannot be used here, or None."""
  try:
    importlib.import_module("triton")
  except ImportError:
    return "triton is not installed"
  _older_triton_compat()
  try:
    importlib.import_module("jax_triton")
  except ImportError as e:
    if getattr(e, "name", None) == "jax_triton":
      return "jax_triton is not installed"
    return f"jax_triton does not import: {e}"
  from jax_triton import triton_lib  # optional dependency, found importable above
  if not isinstance(getattr(triton_lib, "cb", None), types.ModuleType):
    return ("jax_triton loaded without triton's NVIDIA backend (it was imported before jaxmercury "
            "with a triton older than 3.7)")
  return None


@functools.cache
def _kernel():
  """The Triton kernel, defined on first use (triton is imported lazily)."""
  import triton  # optional dependency: only where the kernel is used
  import triton.language as tl  # optional dependency, as above

  @triton.jit
  def forward(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, o_ptr, lse_ptr, scale_log2, n_q, n_kv,
              HEADS: tl.constexpr, GROUP: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
              DP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr,
              PAD: tl.constexpr):
    # One program: BLOCK_Q query rows of one (batch, query head); heads are [hk, g] flattened.
    bh = tl.program_id(1)
    batch, head = (bh // HEADS).to(tl.int64), bh % HEADS
    kv_head = head // GROUP
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, DP)
    row_ok, col_ok = rows < n_q, cols < D
    q_off = ((batch * n_q + rows[:, None]) * HEADS + head) * D + cols[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    qpos = tl.load(qpos_ptr + rows, mask=row_ok, other=-1)
    q_last = tl.max(qpos, 0)
    top = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, DP], tl.float32)
    for start in range(0, n_kv, BLOCK_KV):
      keys = start + tl.arange(0, BLOCK_KV)
      key_ok = keys < n_kv
      kpos = tl.load(kpos_ptr + keys, mask=key_ok, other=PAD)
      k_first = tl.min(kpos, 0)
      if CAUSAL:
        live = k_first <= q_last
      else:
        live = (k_first < PAD) & (q_last >= 0)
      if live:  # some query of the tile sees some key of the block
        kv_off = ((batch * n_kv + keys[:, None]) * KV_HEADS + kv_head) * D + cols[None, :]
        kv_mask = key_ok[:, None] & col_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        if CAUSAL:
          seen = qpos[:, None] >= kpos[None, :]
        else:
          seen = (qpos[:, None] >= 0) & (kpos[None, :] < PAD)
        s = tl.where(seen, s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, 1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        p = tl.exp2(s - safe[:, None])
        fade = tl.exp2(top - safe)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * fade[:, None] + tl.dot(p.to(v.dtype), v)
        total = total * fade + tl.sum(p, 1)
        top = new_top
    empty = total == 0.0
    norm = tl.where(empty, 1.0, total)
    tl.store(o_ptr + q_off, acc / norm[:, None], mask=row_ok[:, None] & col_ok[None, :])
    lse = tl.where(empty, float("-inf"), (top + tl.log2(norm)) * 0.6931471805599453)
    tl.store(lse_ptr + (batch * n_q + rows) * HEADS + head, lse, mask=row_ok)

  return forward


def triton_forward(q, k, v, qpos, kpos, *, causal: bool, block_q: int = 64, block_kv: int = 64):
  """Flash attention of one block through the Triton kernel; arguments as ``flash_forward``.

  Returns:
    ``(out [b, i, hk, g, d], lse [b, i, hk, g])`` float32.
  """
  if (reason := _import_error()) is not None:
    raise RuntimeError(f"triton_attention: {reason}")
  import jax_triton as jt  # optional dependency: only where the kernel is used
  b, n_q, hk, g, d = q.shape
  n_kv = k.shape[1]
  block_q = min(block_q, max(16, 1 << (n_q - 1).bit_length()))
  block_kv = min(block_kv, max(16, 1 << (n_kv - 1).bit_length()))
  out_type = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:4], jnp.float32))
  return jt.triton_call(
      q, k, v, qpos.astype(jnp.int32), kpos.astype(jnp.int32), kernel=_kernel(), out_type=out_type,
      grid=(-(-n_q // block_q), b * hk * g), num_warps=4 if d <= 64 else 8, num_stages=2,
      name="jm_triton_attention", scale_log2=math.log2(math.e) / math.sqrt(d), n_q=n_q, n_kv=n_kv,
      HEADS=hk * g, GROUP=g, KV_HEADS=hk, D=d, DP=max(16, 1 << (d - 1).bit_length()),
      BLOCK_Q=block_q, BLOCK_KV=block_kv, CAUSAL=causal, PAD=PAD_KEY)


def triton_attention_block(ctx, q, k, v, *, causal: bool, block_q: int = 64, block_kv: int = 64):
  """One attention block (the contract of ``attention_block``) through ``triton_forward``."""
  qpos = positions(ctx, "i", PAD_QUERY, mask_invalid=False)
  kpos = positions(ctx, "j", PAD_KEY, mask_invalid=True)
  return triton_forward(q, k, v, qpos, kpos, causal=causal, block_q=block_q, block_kv=block_kv)


def _supports(device) -> str | None:
  """Why ``device`` cannot run the kernel (no triton/jax_triton, not a CUDA GPU of sm80+), or None."""
  if device.platform != "gpu":
    return f"triton_attention needs a GPU, not {device.platform!r}"
  cc = str(getattr(device, "compute_capability", ""))
  if not cc[:1].isdigit():
    return f"triton_attention needs a CUDA GPU (compute capability {cc!r})"
  if int(cc.split(".")[0]) < 8:
    return f"triton_attention needs compute capability 8.0 or newer, device has {cc}"
  return _import_error()


def _make(program, config: ForwardBlocks, interpret: bool):
  del interpret
  return functools.partial(triton_attention_block, causal=program.params["causal"], block_q=config.block_q,
                           block_kv=config.block_kv)


TRITON_ATTENTION = Kernel(
    name="triton_attention", patterns=frozenset({"attention"}), make=_make, config=ForwardBlocks,
    dtypes=frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}), platforms=frozenset({"gpu"}),
    supports=_supports, workspace=lambda program, sizes, config: 4 * sizes["b"] * sizes["hk"] * sizes["g"] * sizes["i"],
    backward=BACKWARD, description="flash attention forward in Triton through jax-triton (sm80 and newer)")
