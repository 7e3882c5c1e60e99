"""Plain programs: each operator as a user would write it in JAX, for XLA (or JAX's own kernels) to run.

A tune always includes them (``jaxmercury.tuner.plain`` lays them out on the
mesh): its answer is never a schedule measured slower than what the user
would otherwise run. Each is a ``Plain``: a name, the implementation it asks
JAX for, where it applies, and ``make(program) -> f(*inputs) -> output`` on
whole arrays with the program's own shapes and dtypes.

- matmul: ``jnp.dot(a, b, preferred_element_type=<the output's dtype>)``;
- attention: ``jax.nn.dot_product_attention``, with cuDNN on GPUs for
  half-precision inputs (causal masks and causal windows as cuDNN's own
  options; segment ids, mask arrays and other windows as one dense boolean
  mask, as a user passes them), with XLA otherwise (the mask likewise);
- moe: ``programs.moe.einsum_dispatch`` (capacity-based one-hot dispatch and combine einsums, as Flax's and
  MaxText's MoE layers write it) where its dispatch tensor fits 1 GiB, and the program's dense reference;
- any other program: its ``reference`` (the loop nest run whole).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxmercury.ir.loops import spec_levels
from jaxmercury.programs.masks import mask_of
from jaxmercury.programs.moe import einsum_dispatch, expert_capacity

XLA, CUDNN = "xla", "cudnn"
IMPLEMENTATION_LABELS = {XLA: "XLA", CUDNN: "cuDNN"}
HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Plain:
  """One plain program of a loop-nest pattern.

  Attributes:
    name: what the user would call, e.g. ``"jnp.dot"``.
    implementation: what runs it: ``"xla"`` or ``"cudnn"``.
    make: ``make(program) -> f(*inputs) -> output`` on whole arrays.
    why_not: ``why_not(program, platform) -> reason | None``: why it does not apply on devices of ``platform``
      (``"cpu"``, ``"gpu"``, ...); None: it applies.
    layout: ``layout(program, specs, sizes) -> specs``: the input layouts (a ``PartitionSpec`` per input) JAX can
      partition the call in, from the caller's ``specs`` on mesh levels of ``sizes`` (``{level: size}``); None:
      any layout (XLA partitions it).
    out_sharding: the function ``make`` returns takes ``out_sharding=`` (a ``NamedSharding``), as ``jnp.dot``
      does: on Explicit mesh axes it is called with the output's, as a user must call it; one that does not is
      called there with those axes made Auto (``jax.sharding.auto_axes``), XLA partitioning it as on Auto axes.
  """

  name: str
  implementation: str
  make: Callable
  why_not: Callable = lambda program, platform: None
  layout: Callable | None = None
  out_sharding: bool = False

  @property
  def label(self) -> str:
    """For display: ``"plain jnp.dot (XLA)"``."""
    return f"plain {self.name} ({IMPLEMENTATION_LABELS.get(self.implementation, self.implementation)})"


def _dot(program):
  out = program.writes.dtype
  return lambda a, b, out_sharding=None: jnp.dot(a, b, preferred_element_type=out, out_sharding=out_sharding)


def _attention(implementation: str):
  def make(program):
    mask = mask_of(program.params)
    if not mask.data and (implementation == CUDNN or mask.kinds <= {"causal"}):
      return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal,
                                                          local_window_size=mask.window,
                                                          implementation=implementation)

    def masked(q, k, v, *extras):  # the mask as one boolean array; rows that keep no key give zeros, as programs do
      keep = mask.dense_keep(q.shape[1], k.shape[1], extras)
      out = jax.nn.dot_product_attention(q, k, v, mask=keep, implementation=implementation)
      rows = jnp.transpose(jnp.any(keep, axis=-1), (0, 2, 1))[..., None]  # [b or 1, q_len, heads or 1, 1]
      return jnp.where(rows, out, jnp.zeros((), out.dtype))
    return masked
  return make


def _cudnn_why_not(program, platform: str) -> str | None:
  if platform != "gpu":
    return f"cuDNN attention runs on GPUs, not {platform}"
  if program.writes.dtype not in HALF:
    return f"cuDNN attention takes bfloat16 or float16, not {program.writes.dtype}"
  mask = mask_of(program.params)
  if not mask.data and mask.window is not None and not (mask.causal and mask.window[1] == 0):
    return f"cuDNN's sliding window is causal (a window (left, 0) with causal), not {mask.describe()}"
  return None


def _entry(levels: tuple[str, ...]):
  return None if not levels else levels[0] if len(levels) == 1 else levels


def _cudnn_layout(program, specs, sizes: dict) -> tuple[PartitionSpec, ...]:
  """The layouts cuDNN's attention is partitioned in: ``q``, ``k`` and ``v`` [b, len, heads, d] split alike, over
  batch and heads only (``jax.nn.dot_product_attention`` raises at compile time for any other). The caller's
  batch and heads splits are kept where the three share them; the mesh levels it splits anything else over
  (a sequence, the head dimension, unlike splits) go to the heads where both head counts divide, else to the
  batch, else nowhere (those levels then hold whole copies).

  Before / after (a sequence split, 8 kv heads, mesh ``x=2``)::

    q [b, i@x, h, d], k, v [b, j@x, hk, d]   ->   q [b, i, h@x, d], k, v [b, j, hk@x, d]

  A data mask's inputs (segment ids, a mask array) are split as q is over batch and heads, and whole along both
  sequences: the dense mask built from them is then split as cuDNN's partitioner takes it.
  """
  q, k, v = (tuple(spec) + (None,) * (4 - len(spec)) for spec in specs[:3])
  batch = spec_levels(q[0]) if q[0] == k[0] == v[0] else ()
  heads = spec_levels(q[2]) if q[2] == k[2] == v[2] else ()
  used = [lv for spec in (q, k, v) for entry in spec for lv in spec_levels(entry)]
  moved = tuple(dict.fromkeys(lv for lv in used if lv not in batch + heads))
  split = lambda levels: math.prod(sizes[lv] for lv in levels)
  b, h, hk = program.buffer("q").shape[0], program.buffer("q").shape[2], program.buffer("k").shape[2]
  if moved and h % split(heads + moved) == 0 and hk % split(heads + moved) == 0:
    heads += moved
  elif moved and b % split(batch + moved) == 0:
    batch += moved
  spec = PartitionSpec(_entry(batch), None, _entry(heads), None)
  levels = {("b",): _entry(batch), ("hk", "g"): _entry(heads)}  # a mask array's batch and query heads, as q's
  extras = [PartitionSpec(*(levels.get(tuple(a.name for a in dim)) for dim in buf.dims)) for buf in program.reads[3:]]
  return (spec,) * 3 + tuple(extras)


def _xla_attention_why_not(program, platform: str) -> str | None:
  if _cudnn_why_not(program, platform) is None:
    return "cuDNN applies: the plain attention a user runs there"
  return None


def _reference(program):
  return program.reference


REFERENCE = Plain("reference", XLA, _reference)

EINSUM_DISPATCH_LIMIT = 1 << 30  # bytes of the one-hot dispatch tensor above which the einsum dispatch is not offered


def _einsum_dispatch(program):
  top_k, factor = program.params["top_k"], program.params["capacity_factor"]
  return lambda *inputs: einsum_dispatch(*inputs, top_k=top_k, capacity_factor=factor)


def _einsum_dispatch_why_not(program, platform: str) -> str | None:
  p = program.params
  capacity = expert_capacity(p["tokens"], p["experts"], p["top_k"], p["capacity_factor"]) or p["tokens"]
  size = p["tokens"] * p["experts"] * min(capacity, p["tokens"]) * program.writes.dtype.itemsize
  if size > EINSUM_DISPATCH_LIMIT:
    return f"its [tokens, experts, capacity] dispatch tensor would take {size / 2 ** 30:.1f} GiB"
  return None

# By pattern: the plain programs, in the order a tune offers them.
PLAIN = {
    "matmul": (Plain("jnp.dot", XLA, _dot, out_sharding=True),),
    "attention": (Plain("dot_product_attention", CUDNN, _attention(CUDNN), _cudnn_why_not, _cudnn_layout),
                  Plain("dot_product_attention", XLA, _attention(XLA), _xla_attention_why_not)),
    # a mixture of experts as Flax's and MaxText's layers write it, and the dense form (every expert, masked)
    "moe": (Plain("einsum_dispatch", XLA, _einsum_dispatch, _einsum_dispatch_why_not), REFERENCE),
}


def known(program) -> tuple[Plain, ...]:
  """Every plain program of ``program``'s pattern (its ``reference`` for patterns without any)."""
  return PLAIN.get(program.pattern, (REFERENCE,))


def applicable(program, platform: str) -> list[Plain]:
  """The plain programs of ``program`` that apply on devices of ``platform``."""
  return [p for p in known(program) if p.why_not(program, platform) is None]


def find(program, name: str, implementation: str) -> Plain | None:
  """The plain program of ``program`` so named, or None."""
  return next((p for p in known(program) if (p.name, p.implementation) == (name, implementation)), None)
