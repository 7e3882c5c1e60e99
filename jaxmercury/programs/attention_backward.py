"""The programs of attention's backward pass, and the forward that keeps its residual.

With the forward's output ``o`` and final log-sum-exp ``lse`` (so that
``delta = rowsum(do * o)``), every (query block, key block) pair's gradients are independent of the
others (FlashAttention-2's backward):

  p = exp(q k^T * scale - lse),  dv = p^T do,  ds = p * (do v^T - delta),
  dq = ds k * scale,  dk = ds^T q * scale.

``dq`` reduces over keys (the forward's loop structure), ``dk`` and ``dv``
over queries: two programs over the same axes, so a forward schedule's trace
replays onto both (see ``jaxmercury.schedules.dual``). Probabilities are
recomputed from ``lse``, never stored; block pairs that the mask hides wholly
are skipped. A masked program's backward programs read its mask's buffers
too, after ``lse``.
"""

import functools
import math

import jax
import jax.numpy as jnp

from jaxmercury.ir.dsl import Axis, grid, match_buffer
from jaxmercury.ir.reductions import LogSumExp, Sum
from jaxmercury.programs.attention import mask_buffers, skip_if_hidden
from jaxmercury.programs.masks import AttentionMask, mask_of


def _axes(p):
  b, hk, g = Axis("b", p["batch"]), Axis("hk", p["kv_heads"]), Axis("g", p["heads"] // p["kv_heads"])
  i, j, d = Axis("i", p["q_len"]), Axis("j", p["kv_len"]), Axis("d", p["head_dim"])
  return b, hk, g, i, j, d


def _probabilities(ctx, q, k, lse, extras, mask):
  scale = 1.0 / math.sqrt(q.shape[-1])
  s = jnp.einsum("bihgd,bjhd->bihgj", q, k, preferred_element_type=jnp.float32) * scale
  keep = mask.keep(ctx, extras, "bihgj", valid_queries=True)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
  return jnp.where(keep, jnp.exp(s - safe), 0.0), scale


def _scores_grad(ctx, q, k, v, o, do, lse, extras, mask):
  p, scale = _probabilities(ctx, q, k, lse, extras, mask)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
  dp = jnp.einsum("bihgd,bjhd->bihgj", do, v, preferred_element_type=jnp.float32)
  return p, p * (dp - delta[..., None]), scale


def _skipping(block):
  """Runs ``block`` unless the mask hides the whole block pair (then zeros): by its positions, or by its data."""
  @functools.wraps(block)
  def run(ctx, q, k, v, o, do, lse, *extras, causal: bool = False, mask: AttentionMask | None = None):
    mask = mask if mask is not None else AttentionMask(causal=causal)
    blocks = (q, k, v, o, do, lse) + extras
    compute = lambda ctx, *x: block(ctx, *x[:6], x[6:], mask)
    if not (mask.positional or mask.data):
      return compute(ctx, *blocks)
    shapes = jax.eval_shape(lambda *x: compute(ctx, *x), *blocks)
    zeros = lambda *x: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    if mask.data:
      skip = ~jnp.any(mask.keep(ctx, extras))
      return jax.lax.cond(skip, zeros, lambda *x: compute(ctx, *x), *blocks)
    return skip_if_hidden(ctx, compute, zeros, *blocks, mask=mask)
  return run


@_skipping
def dq_block(ctx, q, k, v, o, do, lse, extras, mask):
  """dq [b, i, hk, g, d] of one block pair, float32 (called as ``dq_block(ctx, q, k, v, o, do, lse, *extras,
  causal=..., mask=...)``)."""
  _, ds, scale = _scores_grad(ctx, q, k, v, o, do, lse, extras, mask)
  return jnp.einsum("bihgj,bjhd->bihgd", ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale


@_skipping
def dkv_block(ctx, q, k, v, o, do, lse, extras, mask):
  """[dk, dv] stacked as [b, j, hk, 2, d] for one block pair, float32."""
  p, ds, scale = _scores_grad(ctx, q, k, v, o, do, lse, extras, mask)
  dk = jnp.einsum("bihgj,bihgd->bjhd", ds.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale
  dv = jnp.einsum("bihgj,bihgd->bjhd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
  return jnp.stack([dk, dv], axis=3)


@_skipping
def dq_dkv_block(ctx, q, k, v, o, do, lse, extras, mask):
  """``(dq_block(...), dkv_block(...))`` from one computation of the block pair's probabilities: the body of the
  dq and dk-dv programs run in one nest (``lowering.lower.lower_joint``)."""
  p, ds, scale = _scores_grad(ctx, q, k, v, o, do, lse, extras, mask)
  dq = jnp.einsum("bihgj,bjhd->bihgd", ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
  dk = jnp.einsum("bihgj,bihgd->bjhd", ds.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale
  dv = jnp.einsum("bihgj,bihgd->bjhd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
  return dq, jnp.stack([dk, dv], axis=3)


def _backward_buffers(p, dtype):
  b, hk, g, i, j, d = _axes(p)
  reads = (match_buffer("q", (b, i, (hk, g), d), dtype), match_buffer("k", (b, j, hk, d), dtype),
           match_buffer("v", (b, j, hk, d), dtype), match_buffer("o", (b, i, (hk, g), d), dtype),
           match_buffer("do", (b, i, (hk, g), d), dtype), match_buffer("lse", (b, i, (hk, g)), jnp.float32))
  extras = mask_buffers(mask_of(p), dict(b=b, hk=hk, g=g, i=i, j=j))
  return (b, hk, g, i, j, d), reads + extras


def _flops(p, matmuls):
  mask = mask_of(p)
  return 2.0 * matmuls * p["batch"] * p["heads"] * p["q_len"] * p["kv_len"] * p["head_dim"] * mask.kept_share(
      p["q_len"], p["kv_len"])


def attention_with_lse(program):
  """The forward attention program whose output [b, s, h, d + 1] (float32) ends with lse."""
  p = program.params
  b, hk, g, i, j, d = _axes(p)
  e = Axis("e", p["head_dim"] + 1)
  reads = program.reads
  out = match_buffer("olse", (b, i, (hk, g), e), jnp.float32)
  return grid((b, hk, g, i, j), "ssssr", reads=reads, writes=out, body=program.body,
              reduction=LogSumExp(value_axes=("e",), emit_lse=True), name=f"{program.name} with lse",
              pattern="attention", params={**p, "emit_lse": True}, flops=program.flops,
              workspace=program.workspace, statement="olse[b, i, hk*g] <- (attention, logsumexp)")


def attention_dq(program):
  """dq as a program: loops b, hk, g, i spatial and j a plain sum."""
  p, dtype = program.params, program.writes.dtype
  (b, hk, g, i, j, d), reads = _backward_buffers(p, dtype)
  out = match_buffer("dq", (b, i, (hk, g), d), jnp.float32)
  return grid((b, hk, g, i, j), "ssssr", reads=reads, writes=out,
              body=functools.partial(dq_block, mask=mask_of(p)), reduction=Sum(),
              name=f"{program.name} dq", pattern="attention_dq", params={**p, "grad": "dq"},
              flops=_flops(p, 3), workspace=lambda s: 3 * program.workspace(s),
              statement="dq[b, i, hk*g] += ds(b, i, j) k[b, j, hk]")


def attention_dkv(program):
  """[dk, dv] as a program: loops b, hk, j spatial and g, i plain sums."""
  p, dtype = program.params, program.writes.dtype
  (b, hk, g, i, j, d), reads = _backward_buffers(p, dtype)
  two = Axis("kv", 2)
  out = match_buffer("dkv", (b, j, hk, two, d), jnp.float32)
  return grid((b, hk, j, g, i), "sssrr", reads=reads, writes=out,
              body=functools.partial(dkv_block, mask=mask_of(p)), reduction=Sum(),
              name=f"{program.name} dk dv", pattern="attention_dkv", params={**p, "grad": "dkv"},
              flops=_flops(p, 4), workspace=lambda s: 3 * program.workspace(s),
              statement="dk, dv[b, j, hk] += ds^T q, p^T do over i, g")
