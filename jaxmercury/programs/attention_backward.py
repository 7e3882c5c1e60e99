"""The programs of attention's backward pass, and the forward that keeps its residual.

With the forward's output ``o`` and final log-sum-exp ``lse`` (so that
``delta = rowsum(do * o)``), every (query block, key block) pair's gradients are independent of the
others (FlashAttention-2's backward):

  p = exp(q k^T * scale - lse),  dv = p^T do,  ds = p * (do v^T - delta),
  dq = ds k * scale,  dk = ds^T q * scale.

``dq`` reduces over keys (the forward's loop structure), ``dk`` and ``dv``
over queries: two programs over the same axes, so a forward schedule's trace
replays onto both (see ``jaxmercury.schedules.dual``). Probabilities are
recomputed from ``lse``, never stored; causal block pairs that are wholly
masked are skipped.
"""

import functools
import math

import jax
import jax.numpy as jnp

from jaxmercury.ir.dsl import Axis, grid, match_buffer
from jaxmercury.ir.reductions import LogSumExp, Sum
from jaxmercury.programs.attention import skip_if_hidden


def _axes(p):
  b, hk, g = Axis("b", p["batch"]), Axis("hk", p["kv_heads"]), Axis("g", p["heads"] // p["kv_heads"])
  i, j, d = Axis("i", p["q_len"]), Axis("j", p["kv_len"]), Axis("d", p["head_dim"])
  return b, hk, g, i, j, d


def _probabilities(ctx, q, k, lse, causal):
  scale = 1.0 / math.sqrt(q.shape[-1])
  s = jnp.einsum("bihgd,bjhd->bihgj", q, k, preferred_element_type=jnp.float32) * scale
  mask = ctx.valid("j")[None, :] & ctx.valid("i")[:, None]
  if causal:
    mask = mask & (ctx.positions("i")[:, None] >= ctx.positions("j")[None, :])
  mask = mask[None, :, None, None, :]
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
  return jnp.where(mask, jnp.exp(s - safe), 0.0), scale


def _scores_grad(ctx, q, k, v, o, do, lse, causal):
  p, scale = _probabilities(ctx, q, k, lse, causal)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
  dp = jnp.einsum("bihgd,bjhd->bihgj", do, v, preferred_element_type=jnp.float32)
  return p, p * (dp - delta[..., None]), scale


def _skipping(block):
  """Runs ``block`` unless causal masking hides the whole block pair (then zeros)."""
  @functools.wraps(block)
  def run(ctx, *blocks, causal):
    if not causal:
      return block(ctx, *blocks, causal=False)
    shapes = jax.eval_shape(lambda *x: block(ctx, *x, causal=True), *blocks)
    return skip_if_hidden(ctx, functools.partial(block, causal=True),
                          lambda *x: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), *blocks)
  return run


@_skipping
def dq_block(ctx, q, k, v, o, do, lse, *, causal):
  """dq [b, i, hk, g, d] of one block pair, float32."""
  _, ds, scale = _scores_grad(ctx, q, k, v, o, do, lse, causal)
  return jnp.einsum("bihgj,bjhd->bihgd", ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale


@_skipping
def dkv_block(ctx, q, k, v, o, do, lse, *, causal):
  """[dk, dv] stacked as [b, j, hk, 2, d] for one block pair, float32."""
  p, ds, scale = _scores_grad(ctx, q, k, v, o, do, lse, causal)
  dk = jnp.einsum("bihgj,bihgd->bjhd", ds.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale
  dv = jnp.einsum("bihgj,bihgd->bjhd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
  return jnp.stack([dk, dv], axis=3)


@_skipping
def dq_dkv_block(ctx, q, k, v, o, do, lse, *, causal):
  """``(dq_block(...), dkv_block(...))`` from one computation of the block pair's probabilities: the body of the
  dq and dk-dv programs run in one nest (``lowering.lower.lower_joint``)."""
  p, ds, scale = _scores_grad(ctx, q, k, v, o, do, lse, causal)
  dq = jnp.einsum("bihgj,bjhd->bihgd", ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
  dk = jnp.einsum("bihgj,bihgd->bjhd", ds.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale
  dv = jnp.einsum("bihgj,bihgd->bjhd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
  return dq, jnp.stack([dk, dv], axis=3)


def _backward_buffers(p, dtype):
  b, hk, g, i, j, d = _axes(p)
  reads = (match_buffer("q", (b, i, (hk, g), d), dtype), match_buffer("k", (b, j, hk, d), dtype),
           match_buffer("v", (b, j, hk, d), dtype), match_buffer("o", (b, i, (hk, g), d), dtype),
           match_buffer("do", (b, i, (hk, g), d), dtype), match_buffer("lse", (b, i, (hk, g)), jnp.float32))
  return (b, hk, g, i, j, d), reads


def _flops(p, matmuls):
  return 2.0 * matmuls * p["batch"] * p["heads"] * p["q_len"] * p["kv_len"] * p["head_dim"] * (
      0.5 if p["causal"] else 1.0)


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
              body=functools.partial(dq_block, causal=p["causal"]), reduction=Sum(),
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
              body=functools.partial(dkv_block, causal=p["causal"]), reduction=Sum(),
              name=f"{program.name} dk dv", pattern="attention_dkv", params={**p, "grad": "dkv"},
              flops=_flops(p, 4), workspace=lambda s: 3 * program.workspace(s),
              statement="dk, dv[b, j, hk] += ds^T q, p^T do over i, g")
