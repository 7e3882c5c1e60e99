"""Flash attention blocks written in Pallas: forward (with lse), dq and dk/dv.

The kernels use only portable Pallas (``BlockSpec``s, ``pl.ds`` slices,
``lax.fori_loop`` and ``lax.cond``), so they lower through Pallas' Triton
backend on any CUDA GPU (sm80 and newer, Hopper included) and run on CPU with
``interpret=True``.

Masks come from position vectors, not from static offsets, so one compiled
kernel serves every ring step: ``qpos`` holds each query row's true global
position (``-1`` for a padding row) and ``kpos`` each key's (``PAD_KEY`` for a
padding key). Causal masking keeps ``qpos >= kpos``. Every (query block, key
block) pair is classified from the vectors' extremes as hidden (skipped),
fully visible (no mask) or partial (masked), which also covers zigzag layouts
and traced ring offsets.

Layouts are the canonical blocks: q [b, i, hk, g, d], k and v [b, j, hk, d];
query head (hk, g) reads kv head hk. Lengths that are not multiples of the
block size, and head dims that are not powers of two, are padded around the
call (Triton tiles must have power-of-two sides).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxmercury.kernels.config import param
from jaxmercury.kernels.registry import AttentionBackward, Kernel

PAD_KEY = 1 << 30  # the position given to a key that is padding: after every query
PAD_QUERY = -1  # the position given to a query row that is padding: before every key
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
HIDDEN, VISIBLE, PARTIAL = 0, 1, 2  # the cases of a (query block, key block) pair


# ---------------------------------------------------------------- shared helpers

def _block(n: int, want: int) -> int:
  """The tile length for an axis of ``n``: ``want``, or less for a short axis (a power of two >= 16)."""
  return min(want, max(16, pl.next_power_of_2(n)))


def _pad_to(x, axis: int, size: int, value=0):
  """``x`` padded with ``value`` at the end of ``axis`` to ``size``."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _dot(a, b, contract=(1, 0)):
  """A 2-D matmul accumulating in float32; ``contract`` names the contracted dims of a and b."""
  return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                         preferred_element_type=jnp.float32)


def _case(qpos, kpos, causal: bool):
  """HIDDEN, VISIBLE or PARTIAL for a query block and a key block, from their positions."""
  qlo, qhi = jnp.min(qpos), jnp.max(qpos)
  klo, khi = jnp.min(kpos), jnp.max(kpos)
  if causal:
    hidden, visible = klo > qhi, khi <= qlo
  else:
    hidden = (klo >= PAD_KEY) | (qhi < 0)
    visible = (khi < PAD_KEY) & (qlo >= 0)
  # Integer arithmetic, not jnp.where of constants: Triton's lowering types those selects as i1.
  shown, plain = 1 - hidden.astype(jnp.int32), visible.astype(jnp.int32)
  return shown * (PARTIAL - plain * (PARTIAL - VISIBLE))  # HIDDEN is 0


def _mask(qpos, kpos, causal: bool):
  """[rows, keys] visibility: real rows and keys, and keys not after the query when causal."""
  if causal:
    return qpos[:, None] >= kpos[None, :]  # padding rows (-1) and keys (PAD_KEY) fail this too
  return (qpos[:, None] >= 0) & (kpos[None, :] < PAD_KEY)


def _by_case(case, carry, step):
  """``carry`` unchanged for a hidden pair, else ``step(carry, masked)``."""
  return lax.switch(case, [lambda c: c, lambda c: step(c, False), lambda c: step(c, True)], carry)


def _compiler_params(head_dim: int, interpret: bool):
  if interpret:
    return None
  return pl_triton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def positions(ctx, axis: str, padding: int, mask_invalid: bool):
  """The block's true positions along ``axis`` as int32, invalid ones replaced by ``padding``."""
  pos = jnp.asarray(ctx.positions(axis), jnp.int32)
  return jnp.where(ctx.valid(axis), pos, padding) if mask_invalid else pos


# ---------------------------------------------------------------- forward

def _forward_kernel(qpos_ref, kpos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, causal, scale, block_kv):
  """One (head, query block): online softmax over the key blocks, hidden ones skipped."""
  q, qpos = q_ref[...], qpos_ref[...]
  rows, width = q.shape

  def step(carry, masked, start, kpos):
    acc, top, total = carry
    s = _dot(q, k_ref[pl.ds(start, block_kv), :], (1, 1)) * (scale * LOG2E)  # base-2 logits
    if masked:
      s = jnp.where(_mask(qpos, kpos, causal), s, -jnp.inf)
    new_top = jnp.maximum(top, jnp.max(s, axis=1))
    safe = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # a row with nothing visible yet
    p = jnp.exp2(s - safe[:, None])
    fade = jnp.exp2(top - safe)
    v = v_ref[pl.ds(start, block_kv), :]
    acc = acc * fade[:, None] + _dot(p.astype(v.dtype), v)
    return acc, new_top, total * fade + jnp.sum(p, axis=1)

  def visit(kb, carry):
    start = pl.multiple_of(kb * block_kv, block_kv)
    kpos = kpos_ref[pl.ds(start, block_kv)]
    return _by_case(_case(qpos, kpos, causal), carry,
                    lambda c, masked: step(c, masked, start, kpos))

  init = (jnp.zeros((rows, width), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  acc, top, total = lax.fori_loop(0, k_ref.shape[0] // block_kv, visit, init)
  empty = total == 0.0
  o_ref[...] = acc / jnp.where(empty, 1.0, total)[:, None]
  lse_ref[...] = jnp.where(empty, -jnp.inf, (top + jnp.log2(jnp.where(empty, 1.0, total))) * LN2)


def flash_forward(q, k, v, qpos, kpos, *, causal: bool, block_q: int = 64, block_kv: int = 64,
                  interpret: bool = False):
  """Flash attention of one block with its log-sum-exp.

  Args:
    q: [b, i, hk, g, d] queries.
    k: [b, j, hk, d] keys.
    v: [b, j, hk, d] values.
    qpos: [i] int32 true positions of the query rows.
    kpos: [j] int32 true positions of the keys, ``PAD_KEY`` for padding keys.
    causal: mask keys after the query.
    block_q: query tile length.
    block_kv: key tile length.
    interpret: run in Pallas interpret mode (CPU).

  Returns:
    ``(out [b, i, hk, g, d], lse [b, i, hk, g])`` float32; rows with no
    visible key give ``out = 0``, ``lse = -inf``.
  """
  b, ni, hk, g, d = q.shape
  nj = k.shape[1]
  bq, bk, dp = _block(ni, block_q), _block(nj, block_kv), max(16, pl.next_power_of_2(d))
  pi, pj = _round_up(ni, bq), _round_up(nj, bk)
  q = _pad_to(_pad_to(q, 1, pi), 4, dp)
  k, v = (_pad_to(_pad_to(x, 1, pj), 3, dp) for x in (k, v))
  qpos, kpos = _pad_to(qpos, 0, pi, PAD_QUERY), _pad_to(kpos, 0, pj, PAD_KEY)
  heads = hk * g

  def q_map(h, qi):
    return h // heads, qi, (h // g) % hk, h % g, 0

  kernel = functools.partial(_forward_kernel, causal=causal, scale=1.0 / math.sqrt(d), block_kv=bk)
  out, lse = pl.pallas_call(
      kernel, grid=(b * heads, pi // bq),
      in_specs=[pl.BlockSpec((bq,), lambda h, qi: (qi,)),
                pl.BlockSpec((pj,), lambda h, qi: (0,)),
                pl.BlockSpec((None, bq, None, None, dp), q_map),
                pl.BlockSpec((None, pj, None, dp), lambda h, qi: (h // heads, 0, (h // g) % hk, 0)),
                pl.BlockSpec((None, pj, None, dp), lambda h, qi: (h // heads, 0, (h // g) % hk, 0))],
      out_specs=[pl.BlockSpec((None, bq, None, None, dp), q_map),
                 pl.BlockSpec((None, bq, None, None), lambda h, qi: q_map(h, qi)[:4])],
      out_shape=[jax.ShapeDtypeStruct((b, pi, hk, g, dp), jnp.float32),
                 jax.ShapeDtypeStruct((b, pi, hk, g), jnp.float32)],
      compiler_params=_compiler_params(dp, interpret), interpret=interpret,
      name="jm_flash_forward")(qpos, kpos, q, k, v)
  return out[:, :ni, :, :, :d], lse[:, :ni]


def pallas_attention_block(ctx, q, k, v, *, causal: bool, block_q: int = 64, block_kv: int = 64,
                           interpret: bool = False):
  """One attention block (the contract of ``attention_block``) through ``flash_forward``."""
  qpos = positions(ctx, "i", PAD_QUERY, mask_invalid=False)  # as the body: padding rows attend
  kpos = positions(ctx, "j", PAD_KEY, mask_invalid=True)
  return flash_forward(q, k, v, qpos, kpos, causal=causal, block_q=block_q, block_kv=block_kv,
                       interpret=interpret)


# ---------------------------------------------------------------- backward

def _probabilities(q, k, lse2, qpos, kpos, masked, causal, scale):
  """p [rows, keys] recomputed from the base-2 log-sum-exp ``lse2``."""
  p = jnp.exp2(_dot(q, k, (1, 1)) * (scale * LOG2E) - lse2[:, None])
  return jnp.where(_mask(qpos, kpos, causal), p, 0.0) if masked else p


def _dq_kernel(qpos_ref, kpos_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               causal, scale, block_kv):
  """One (head, query block): dq = sum over key blocks of ds k, hidden ones skipped."""
  q, do, qpos = q_ref[...], do_ref[...], qpos_ref[...]
  lse2, delta = lse_ref[...], delta_ref[...]

  def step(dq, masked, start, kpos):
    k, v = k_ref[pl.ds(start, block_kv), :], v_ref[pl.ds(start, block_kv), :]
    p = _probabilities(q, k, lse2, qpos, kpos, masked, causal, scale)
    ds = p * (_dot(do, v, (1, 1)) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  def visit(kb, dq):
    start = pl.multiple_of(kb * block_kv, block_kv)
    kpos = kpos_ref[pl.ds(start, block_kv)]
    return _by_case(_case(qpos, kpos, causal), dq, lambda c, masked: step(c, masked, start, kpos))

  dq = lax.fori_loop(0, k_ref.shape[0] // block_kv, visit, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq * scale


def _dkv_kernel(qpos_ref, kpos_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dkv_ref, *,
                causal, scale, block_q):
  """One (kv head, key block): dk, dv summed over the group's heads and the query blocks."""
  k, v, kpos = k_ref[...], v_ref[...], kpos_ref[...]
  n_q, groups = q_ref.shape[0] // block_q, q_ref.shape[1]

  def step(carry, masked, start, gi, qpos):
    dk, dv = carry
    rows = pl.ds(start, block_q)
    q, do = q_ref[rows, gi, :], do_ref[rows, gi, :]
    p = _probabilities(q, k, lse_ref[rows, gi], qpos, kpos, masked, causal, scale)
    ds = p * (_dot(do, v, (1, 1)) - delta_ref[rows, gi][:, None])
    return dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv + _dot(p.astype(do.dtype), do, (0, 0))

  def visit(t, carry):
    n = jnp.int32(n_q)
    gi, qi = lax.div(t, n), lax.rem(t, n)  # jnp's floor division does not lower to Triton
    start = pl.multiple_of(qi * block_q, block_q)
    qpos = qpos_ref[pl.ds(start, block_q)]
    return _by_case(_case(qpos, kpos, causal), carry,
                    lambda c, masked: step(c, masked, start, gi, qpos))

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, groups * n_q, visit, (zeros, zeros))
  dkv_ref[:, 0, :] = dk * scale
  dkv_ref[:, 1, :] = dv


def _backward_operands(q, k, v, o, do, lse, qpos, kpos, bq, bk):
  """Padded operands of the backward kernels, with base-2 lse and delta = rowsum(do * o)."""
  d = q.shape[-1]
  dp = max(16, pl.next_power_of_2(d))
  pi, pj = _round_up(q.shape[1], bq), _round_up(k.shape[1], bk)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
  lse2 = jnp.where(jnp.isfinite(lse), lse, 0.0) * LOG2E
  rows = lambda x: _pad_to(_pad_to(x, 1, pi), 4, dp)
  keys = lambda x: _pad_to(_pad_to(x, 1, pj), 3, dp)
  return (_pad_to(qpos, 0, pi, PAD_QUERY), _pad_to(kpos, 0, pj, PAD_KEY), rows(q), keys(k), keys(v),
          rows(do), _pad_to(lse2, 1, pi), _pad_to(delta, 1, pi)), dp


def flash_dq(q, k, v, o, do, lse, qpos, kpos, *, causal: bool, block_q: int = 64, block_kv: int = 64,
             interpret: bool = False):
  """dq [b, i, hk, g, d] float32 of one block pair (FlashAttention-2 backward).

  Args:
    q, k, v: the block's inputs, canonical layouts.
    o, do: [b, i, hk, g, d] the merged forward output and its cotangent.
    lse: [b, i, hk, g] the merged forward log-sum-exp (natural log).
    qpos: [i] int32 query positions, ``PAD_QUERY`` for padding rows.
    kpos: [j] int32 key positions, ``PAD_KEY`` for padding keys.
    causal, block_q, block_kv, interpret: as ``flash_forward``.
  """
  b, ni, hk, g, d = q.shape
  bq, bk = _block(ni, block_q), _block(k.shape[1], block_kv)
  ops, dp = _backward_operands(q, k, v, o, do, lse, qpos, kpos, bq, bk)
  pi, pj = ops[2].shape[1], ops[3].shape[1]
  heads = hk * g

  def q_map(h, qi):
    return h // heads, qi, (h // g) % hk, h % g, 0

  kv_spec = pl.BlockSpec((None, pj, None, dp), lambda h, qi: (h // heads, 0, (h // g) % hk, 0))
  row_spec = pl.BlockSpec((None, bq, None, None), lambda h, qi: q_map(h, qi)[:4])
  kernel = functools.partial(_dq_kernel, causal=causal, scale=1.0 / math.sqrt(d), block_kv=bk)
  dq = pl.pallas_call(
      kernel, grid=(b * heads, pi // bq),
      in_specs=[pl.BlockSpec((bq,), lambda h, qi: (qi,)), pl.BlockSpec((pj,), lambda h, qi: (0,)),
                pl.BlockSpec((None, bq, None, None, dp), q_map), kv_spec, kv_spec,
                pl.BlockSpec((None, bq, None, None, dp), q_map), row_spec, row_spec],
      out_specs=pl.BlockSpec((None, bq, None, None, dp), q_map),
      out_shape=jax.ShapeDtypeStruct((b, pi, hk, g, dp), jnp.float32),
      compiler_params=_compiler_params(dp, interpret), interpret=interpret,
      name="jm_flash_dq")(*ops)
  return dq[:, :ni, :, :, :d]


def flash_dkv(q, k, v, o, do, lse, qpos, kpos, *, causal: bool, block_q: int = 64, block_kv: int = 64,
              interpret: bool = False):
  """[dk, dv] stacked as [b, j, hk, 2, d] float32 of one block pair; arguments as ``flash_dq``."""
  b, ni, hk, g, d = q.shape
  nj = k.shape[1]
  bq, bk = _block(ni, block_q), _block(nj, block_kv)
  ops, dp = _backward_operands(q, k, v, o, do, lse, qpos, kpos, bq, bk)
  pi, pj = ops[2].shape[1], ops[3].shape[1]
  group = pl.BlockSpec((None, pi, None, g, dp), lambda h, kb: (h // hk, 0, h % hk, 0, 0))
  group_rows = pl.BlockSpec((None, pi, None, g), lambda h, kb: (h // hk, 0, h % hk, 0))
  keys = pl.BlockSpec((None, bk, None, dp), lambda h, kb: (h // hk, kb, h % hk, 0))
  kernel = functools.partial(_dkv_kernel, causal=causal, scale=1.0 / math.sqrt(d), block_q=bq)
  dkv = pl.pallas_call(
      kernel, grid=(b * hk, pj // bk),
      in_specs=[pl.BlockSpec((pi,), lambda h, kb: (0,)), pl.BlockSpec((bk,), lambda h, kb: (kb,)),
                group, keys, keys, group, group_rows, group_rows],
      out_specs=pl.BlockSpec((None, bk, None, 2, dp), lambda h, kb: (h // hk, kb, h % hk, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((b, pj, hk, 2, dp), jnp.float32),
      compiler_params=_compiler_params(dp, interpret), interpret=interpret,
      name="jm_flash_dkv")(*ops)
  return dkv[:, :nj, :, :, :d]


def pallas_backward_block(ctx, q, k, v, o, do, lse, *, causal: bool, part: str, block_q: int = 64,
                          block_kv: int = 64, interpret: bool = False):
  """One block pair's dq (``part="dq"``) or stacked [dk, dv] (``"dkv"``), as ``dq_block``/``dkv_block``."""
  qpos = positions(ctx, "i", PAD_QUERY, mask_invalid=True)
  kpos = positions(ctx, "j", PAD_KEY, mask_invalid=True)
  grad = flash_dq if part == "dq" else flash_dkv
  return grad(q, k, v, o, do, lse, qpos, kpos, causal=causal, block_q=block_q, block_kv=block_kv,
              interpret=interpret)


# ---------------------------------------------------------------- registration

def _supports(device) -> str | None:
  """Why ``device`` cannot run the Triton lowering of these kernels, or None."""
  if device.platform != "gpu":
    return f"Pallas Triton kernels need a GPU, not {device.platform!r} (use interpret mode on CPU)"
  cc = getattr(device, "compute_capability", None)
  try:
    major = int(str(cc).split(".")[0])
  except ValueError:
    return None  # unknown (e.g. ROCm): let compilation decide
  return None if major >= 8 else f"needs compute capability 8.0 or newer, device has {cc}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardBlocks:
  """The forward kernel's blocks; the held (not streamed) side may grow."""

  block_q: int = param(64, 128)
  block_kv: int = param(64, 128)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DqBlocks:
  block_q: int = param(64, 128)
  block_kv: int = param(64, 32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DkvBlocks:
  block_q: int = param(64, 32)
  block_kv: int = param(64, 128)


def _make_forward(program, config: ForwardBlocks, interpret: bool):
  return functools.partial(pallas_attention_block, causal=program.params["causal"], block_q=config.block_q,
                           block_kv=config.block_kv, interpret=interpret)


def _make_backward(part):
  def make(program, config, interpret: bool):
    return functools.partial(pallas_backward_block, causal=program.params["causal"], part=part,
                             block_q=config.block_q, block_kv=config.block_kv, interpret=interpret)
  return make


def _workspace(program, sizes, config):
  """Scratch of one call besides inputs and output: the lse and delta rows (no scores are stored)."""
  return 2 * 4 * sizes["b"] * sizes["hk"] * sizes["g"] * sizes["i"]


DTYPES = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)})


def _backward_kernel(part: str, config: type) -> Kernel:
  return Kernel(name=f"pallas_attention_{part}", patterns=frozenset({f"attention_{part}"}),
                make=_make_backward(part), config=config, dtypes=DTYPES, platforms=frozenset({"gpu"}),
                dtype_of="q", supports=_supports, interpret=True, workspace=_workspace,
                description=f"the Pallas flash attention {part} kernel (Triton lowering)")


BACKWARD = AttentionBackward(dq=_backward_kernel("dq", DqBlocks), dkv=_backward_kernel("dkv", DkvBlocks))

PALLAS_ATTENTION = Kernel(
    name="pallas_attention", patterns=frozenset({"attention"}), make=_make_forward, config=ForwardBlocks,
    dtypes=DTYPES, platforms=frozenset({"gpu"}), supports=_supports, interpret=True, workspace=_workspace,
    backward=BACKWARD, description="flash attention in portable Pallas (Triton lowering; interpret mode on CPU)")
