"""A user's attention kernel, declared and registered from outside jaxmercury (``tests/test_extending.py``).

It computes a block's attention over its keys in chunks of ``chunk`` keys with the online-softmax merge (its
own code, not the program's body), and declares its backward: block kernels for the dq and dk-dv programs and a
joint block that returns both, each counting the calls traced through it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from jaxmercury import kernels
from jaxmercury.programs.attention_backward import dq_dkv_block

TRACED = {"forward": 0, "dq": 0, "dkv": 0, "joint": 0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunks:
  chunk: int = kernels.param(8, 16)


def _attend(ctx, q, k, v, *, causal: bool, chunk: int):
  """``(out [b, i, hk, g, d], lse [b, i, hk, g])`` in float32, keys taken ``chunk`` at a time."""
  TRACED["forward"] += 1
  scale = 1.0 / math.sqrt(q.shape[-1])
  qpos, kpos, kvalid = ctx.positions("i"), ctx.positions("j"), ctx.valid("j")
  top = jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)
  total = jnp.zeros(q.shape[:-1], jnp.float32)
  acc = jnp.zeros(q.shape, jnp.float32)
  for start in range(0, k.shape[1], chunk):
    kc, vc = k[:, start:start + chunk], v[:, start:start + chunk]
    s = jnp.einsum("bihgd,bjhd->bihgj", q, kc, preferred_element_type=jnp.float32) * scale
    keep = kvalid[start:start + chunk][None, :]
    if causal:
      keep = keep & (qpos[:, None] >= kpos[start:start + chunk][None, :])
    s = jnp.where(keep[None, :, None, None, :], s, -jnp.inf)
    new_top = jnp.maximum(top, jnp.max(s, axis=-1))
    safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    p = jnp.exp(s - safe[..., None])
    rescale = jnp.exp(jnp.where(jnp.isfinite(top), top - safe, -jnp.inf))
    total = total * rescale + jnp.sum(p, axis=-1)
    acc = acc * rescale[..., None] + jnp.einsum("bihgj,bjhd->bihgd", p, vc.astype(jnp.float32))
    top = new_top
  out = acc / jnp.where(total == 0, 1.0, total)[..., None]
  lse = jnp.where(total == 0, -jnp.inf, jnp.where(jnp.isfinite(top), top, 0.0) + jnp.log(total))
  return out, lse


def _forward(program, config: Chunks, interpret: bool):
  return functools.partial(_attend, causal=program.params["causal"], chunk=config.chunk)


def _counted(part: str):
  def make(program, config, interpret):
    def block(ctx, *blocks):
      TRACED[part] += 1
      return program.body(ctx, *blocks)
    return block
  return make


def _joint(dq_program):
  def block(ctx, *blocks):
    TRACED["joint"] += 1
    return dq_dkv_block(ctx, *blocks, causal=dq_program.params["causal"])
  return block


def _work(block, *, causal: bool, config: Chunks):
  return kernels.Work(fast=block.causal_share() if causal else 1.0)


def _workspace(program, sizes, config: Chunks):
  """One chunk's float32 scores and probabilities."""
  return 2 * 4 * sizes["b"] * sizes["i"] * sizes["hk"] * sizes["g"] * config.chunk


F32 = frozenset({np.dtype(np.float32)})

MY_ATTENTION = kernels.Kernel(
    name="my_attention", patterns=frozenset({"attention"}), make=_forward, config=Chunks, dtypes=F32,
    work=_work, workspace=_workspace, description="a user's chunked attention",
    backward=kernels.AttentionBackward(
        dq=kernels.Kernel(name="my_attention_dq", patterns=frozenset({"attention_dq"}), make=_counted("dq"),
                          dtypes=F32, dtype_of="q"),
        dkv=kernels.Kernel(name="my_attention_dkv", patterns=frozenset({"attention_dkv"}), make=_counted("dkv"),
                           dtypes=F32, dtype_of="q"),
        joint=_joint))
