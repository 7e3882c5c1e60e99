"""A Mixtral-style mixture-of-experts decoder block in Flax NNX: Llama's attention, then a top-k routed SwiGLU MoE.

``MoE`` keeps its expert computation in a ``moe_fn`` attribute (the way
``models.llama.Attention`` keeps ``attention_fn``), so ``jaxmercury.distribute``
routes it to ``jaxmercury.ops.moe`` (expert parallel: tokens exchanged by a
routed all-to-all). Undistributed, ``moe_fn`` is ``einsum_moe``
(``jaxmercury.programs.moe.einsum_dispatch``, also the moe program's plain program in a tune): plain JAX
written the way Flax's and MaxText's MoE layers write it, a capacity-based
einsum dispatch (one-hot dispatch and combine tensors of shape
``[tokens, experts, capacity]``), with the semantics of ``programs.moe``
(top-k by logit, softmax over the kept logits, capacity in token order,
dropped assignments contribute zero).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from flax import nnx

from jaxmercury.programs.moe import einsum_dispatch as einsum_moe
from models.llama import Attention, LlamaConfig, RMSNorm


@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
  """Llama's sizes plus the experts: ``hidden`` is one expert's hidden width.

  Attributes:
    experts: experts per MoE layer.
    top_k: experts each token is routed to.
    capacity_factor: None for dropless, else each expert keeps ``ceil(factor * tokens * top_k / experts)``
      assignments.
  """

  experts: int = 8
  top_k: int = 2
  capacity_factor: float | None = None


CONFIGS = {
    "tiny": MixtralConfig(dim=64, heads=4, kv_heads=2, head_dim=16, hidden=96, layers=2, vocab=256,
                          rope_theta=10000.0, experts=8, top_k=2),
    "mixtral_8x7b": MixtralConfig(dim=4096, heads=32, kv_heads=8, head_dim=128, hidden=14336, layers=32,
                                  vocab=32000, rope_theta=1e6, experts=8, top_k=2),
}


class MoE(nnx.Module):
  """Top-k routed SwiGLU experts; ``moe_fn`` computes the layer from the tokens and the five weights."""

  def __init__(self, config: MixtralConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    normal = nnx.initializers.normal

    def param(shape, fan_in):
      return nnx.Param(normal(fan_in ** -0.5)(rngs.params(), shape, c.param_dtype))

    self.router = param((c.dim, c.experts), c.dim)
    self.w_gate = param((c.experts, c.dim, c.hidden), c.dim)
    self.w_up = param((c.experts, c.dim, c.hidden), c.dim)
    self.w_down = param((c.experts, c.hidden, c.dim), c.hidden)
    self.moe_fn = einsum_moe

  def __call__(self, x):
    c = self.config
    x = x.astype(c.dtype)
    weights = [w[...].astype(c.dtype) for w in (self.router, self.w_gate, self.w_up, self.w_down)]
    return self.moe_fn(x, *weights, top_k=c.top_k, capacity_factor=c.capacity_factor)


class MixtralBlock(nnx.Module):
  """``x + attention(norm(x))``, then ``+ moe(norm(.))``."""

  def __init__(self, config: MixtralConfig, *, rngs: nnx.Rngs):
    c = config
    norm = functools.partial(RMSNorm, c.dim, eps=c.norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    self.attention_norm = norm()
    self.attention = Attention(c, rngs=rngs)
    self.moe_norm = norm()
    self.moe = MoE(c, rngs=rngs)

  def __call__(self, x, positions=None):
    positions = jnp.arange(x.shape[1]) if positions is None else positions
    x = x + self.attention(self.attention_norm(x), positions)
    return x + self.moe(self.moe_norm(x))
