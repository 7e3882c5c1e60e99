"""How a local attention kernel takes a causal block at traced offsets (ring steps): by its position.

Run time (``dispatch``): a block whose keys all precede its queries is
visible (the kernel, unmasked); one whose keys all follow them is hidden
(skipped: an empty state, or zero gradients); one that overlaps partly is,
when query and key blocks have one size (they start at multiples of it), the
diagonal, which the kernel's causal path takes; otherwise the program's own
body computes it. Before tracing (``dispatch_work``): the same choice as
shares of the block's work, for the cost model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmercury.kernels.work import Block, Work, body_share
from jaxmercury.programs.attention import empty_state  # noqa: F401  (the kernels' hidden-block state)

VISIBLE, HIDDEN, PARTIAL = 0, 1, 2


def takes_whole(block, *, backward: bool) -> bool:
  """Whether a kernel may take ``block`` (a ``BlockContext`` when traced, a ``Block`` when planning) at all: no
  padded keys (nor queries, backward) and one chunk along each axis."""
  padded = block.extents["j"] % block.sizes["j"] or (backward and block.extents["i"] % block.sizes["i"])
  return not padded and block.contiguous("i") and block.contiguous("j")


def pick(part: str):
  """``(dq, dk, dv) ->`` what a backward block of ``part`` returns: ``dq``, ``[dk, dv]`` stacked on axis 3
  (``"dkv"``) or both (``"dq_dkv"``, a joint nest's block)."""
  return {"dq": lambda dq, dk, dv: dq, "dkv": lambda dq, dk, dv: jnp.stack([dk, dv], axis=3),
          "dq_dkv": lambda dq, dk, dv: (dq, jnp.stack([dk, dv], axis=3))}[part]


def position_case(ctx):
  """``VISIBLE`` if every key of the block precedes every query, ``HIDDEN`` if every key follows, else ``PARTIAL``."""
  tq, tk = ctx.sizes["i"], ctx.sizes["j"]
  qs, ks = ctx.start("i"), ctx.start("j")
  return jnp.where(ks + tk - 1 <= qs, VISIBLE, jnp.where(ks > qs + tq - 1, HIDDEN, PARTIAL))


def band_cover(ctx, band):
  """``(hidden, visible)``: whether ``band`` (``lo <= query - key <= hi``, None unbounded) keeps none or all of the
  block's pairs, from its extremes of query - key; Python bools where the block's starts are static, else
  traced."""
  lo, hi = band
  qs, ks = ctx.start("i"), ctx.start("j")
  d_min, d_max = qs - ks - (ctx.sizes["j"] - 1), qs - ks + (ctx.sizes["i"] - 1)
  hidden, visible = False, True
  if lo is not None:
    hidden, visible = hidden | (d_max < lo), visible & (d_min >= lo)
  if hi is not None:
    hidden, visible = hidden | (d_min > hi), visible & (d_max <= hi)
  return hidden, visible


def causal_window(band, tq: int):
  """cuDNN's ``sliding_window_length`` for a causal ``band`` (``(0, hi)``) on a diagonal block of ``tq`` queries:
  None where the window covers the block (plain causal)."""
  hi = band[1]
  return hi + 1 if hi is not None and hi < tq - 1 else None


def dispatch(ctx, operands, *, visible, hidden, partial):
  """``visible(*operands)``, ``hidden(*operands)`` or ``partial(*operands)`` by the block's ``position_case``."""
  return jax.lax.switch(position_case(ctx), [visible, hidden, partial], *operands)


def dispatch_work(block: Block, causal: bool, whole: bool, diagonal: bool = True) -> Work:
  """The work of a kernel that takes ``block`` (``whole``) and dispatches it as above.

  Args:
    block: the body call.
    causal: the program's mask.
    whole: the kernel takes the block at all (else the body computes it).
    diagonal: the kernel's causal path takes a partly masked block of equal
      query and key sizes (skipping what it hides); else the body does.
  """
  if not whole:
    return Work(fast=0.0, fallback=body_share(block, causal))
  if not causal:
    return Work()
  case = block.causal_case()
  if case == "visible":
    return Work()
  if case == "hidden":
    return Work(fast=0.0)
  if diagonal and block.sizes["i"] == block.sizes["j"]:
    return Work(fast=block.causal_share())
  return Work(fast=0.0, fallback=1.0)
