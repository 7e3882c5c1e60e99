"""Attention masks: which (query, key) pairs attention keeps, and the buffers that carry them.

A mask combines, as ``jax.nn.dot_product_attention`` does (every part must
keep a pair):

* positional parts, known before running: ``causal`` (a key at or before
  its query, top-left aligned) and a sliding ``window`` ``(left, right)``
  (``local_window_size``: query ``q`` keeps keys ``q - left .. q + right``).
  Together they are a *band*: ``lo <= q - k <= hi`` (``AttentionMask.band``).
  A block of queries and keys that the band hides is skipped, and a ring
  skips the steps at which no rank's block is in the band, their transfers
  included;
* data parts, known only when running: segment ids (packed sequences: a
  query keeps the keys of its own segment; buffers ``q_segment_ids [b, i]``
  and ``kv_segment_ids [b, j]``, int32) and a boolean mask array (buffer
  ``mask`` over some of ``b``, ``h`` (query heads), ``i``, ``j``; the others
  broadcast). Blocks they hide wholly are skipped at run time (``lax.cond``);
  a ring around which segment ids travel also skips the steps they leave
  empty (``programs.packing``, ``lowering.nest``).

Rows that keep no key give a zero output (and a log-sum-exp of ``-inf``), as
``query_seq_lengths`` padding does in JAX. JAX's XLA path gives such a row,
when it is within the query length, the mean of every value instead (its
masked scores are a large finite negative, not ``-inf``); models do not read
those rows.

``attention_mask(query, key, ...)`` reads a ``jax.nn.dot_product_attention``
call's arguments and returns the ``AttentionMask`` a program takes, or raises
``MaskError`` saying why jaxmercury cannot express it; ``AttentionMask.inputs``
turns the same arguments into the program's extra input arrays.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import MaskError

Q_SEGMENTS, KV_SEGMENTS, MASK = "q_segment_ids", "kv_segment_ids", "mask"
MASK_AXES = ("b", "h", "i", "j")  # a mask array's possible axes, in order (h: query heads, hk * g)
SCORE_AXES = ("b", "hk", "g", "i", "j")  # its canonical axes (h split into kv head and group)
KINDS = ("causal", "window", "segment_ids", "mask")
PAD_QUERY_SEGMENT = np.iinfo(np.int32).min  # the segment id of a query past query_seq_lengths: no key has it
_PAD_KEY = np.iinfo(np.int32).min + 1  # the segment id of a key past key_value_seq_lengths


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionMask:
  """Which (query, key) pairs attention keeps.

  Attributes:
    causal: keys at or before their query only (top-left aligned).
    window: ``(left, right)``: query ``q`` keeps keys ``q - left`` to
      ``q + right`` (``jax.nn.dot_product_attention``'s ``local_window_size``);
      None: no window.
    segment_ids: the program reads ``q_segment_ids [b, i]`` and
      ``kv_segment_ids [b, j]`` (int32); a query keeps the keys of its segment.
    mask_axes: the program reads a boolean ``mask`` over these of ``("b", "h",
      "i", "j")``, in that order (the others broadcast); None: no mask array.
  """

  causal: bool = False
  window: tuple[int, int] | None = None
  segment_ids: bool = False
  mask_axes: tuple[str, ...] | None = None

  def __post_init__(self):
    if self.window is not None:
      window = tuple(self.window)
      if len(window) != 2 or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 0
                                     for w in window):
        raise MaskError(f"window {self.window!r}: give (left, right), two non-negative ints (a single int w "
                        "means (w, w), as local_window_size)")
      object.__setattr__(self, "window", (int(window[0]), int(window[1])))
    if self.mask_axes is not None:
      axes = tuple(self.mask_axes)
      if not axes or any(a not in MASK_AXES for a in axes) or list(axes) != sorted(axes, key=MASK_AXES.index) \
          or len(set(axes)) != len(axes):
        raise MaskError(f"mask_axes {self.mask_axes!r}: give a non-empty subset of {MASK_AXES}, in that order")
      object.__setattr__(self, "mask_axes", axes)

  # ------------------------------------------------------------------ structure
  @property
  def band(self) -> tuple[int | None, int | None]:
    """``(lo, hi)``: the positional parts keep ``lo <= q - k <= hi`` (None: unbounded)."""
    lo = 0 if self.causal else None
    hi = None
    if self.window is not None:
      left, right = self.window
      lo = -right if lo is None else max(lo, -right)
      hi = left
    return lo, hi

  @property
  def positional(self) -> bool:
    """Whether positions alone hide some pairs (causal or a window)."""
    return self.band != (None, None)

  @property
  def data(self) -> bool:
    """Whether the inputs hide some pairs (segment ids or a mask array)."""
    return self.segment_ids or self.mask_axes is not None

  @property
  def kinds(self) -> frozenset[str]:
    """The parts it has, among ``KINDS``."""
    present = (self.causal, self.window is not None, self.segment_ids, self.mask_axes is not None)
    return frozenset(k for k, on in zip(KINDS, present) if on)

  @property
  def buffers(self) -> tuple[str, ...]:
    """Names of the extra read buffers, in the program's order (after q, k, v)."""
    return ((Q_SEGMENTS, KV_SEGMENTS) if self.segment_ids else ()) + ((MASK,) if self.mask_axes else ())

  def params(self) -> dict:
    """The program parameters that record it (only parts it has; JSON values)."""
    out = {}
    if self.window is not None:
      out["window"] = list(self.window)
    if self.segment_ids:
      out["segment_ids"] = True
    if self.mask_axes is not None:
      out["mask_axes"] = list(self.mask_axes)
    return out

  def describe(self) -> str:
    """One line: ``causal, window (4, 0), q_segment_ids == kv_segment_ids, mask[b, i, j]``."""
    parts = ["causal"] if self.causal else []
    if self.window is not None:
      parts.append(f"window {self.window}")
    if self.segment_ids:
      parts.append(f"{Q_SEGMENTS}[b, i] == {KV_SEGMENTS}[b, j]")
    if self.mask_axes is not None:
      parts.append(f"{MASK}[{', '.join(self.mask_axes)}]")
    return ", ".join(parts) or "none"

  def name(self) -> str:
    """The program's name: ``attention``, ``causal attention``, ``causal windowed segmented masked attention``."""
    words = [w for w, on in (("causal", self.causal), ("windowed", self.window is not None),
                             ("segmented", self.segment_ids), ("masked", self.mask_axes is not None)) if on]
    return " ".join(words + ["attention"])

  def kept_share(self, q_len: int, kv_len: int) -> float:
    """The share of a ``q_len`` x ``kv_len`` attention's pairs the positional parts keep: a causal mask alone
    counts half (as programs always have), a window its exact count; data parts count as keeping everything."""
    if self.window is None:
      return 0.5 if self.causal else 1.0
    return band_pairs((0, q_len), (0, kv_len), self.band) / (q_len * kv_len)

  # ------------------------------------------------------------------ a block's mask, traced
  def position_hidden(self, ctx):
    """Whether the positional parts hide every pair of the block (a traced bool; False without them)."""
    lo, hi = self.band
    qpos, kpos = ctx.positions("i"), ctx.positions("j")
    hidden = jnp.asarray(False)
    if lo is not None:
      hidden = hidden | (jnp.max(qpos) - jnp.min(kpos) < lo)
    if hi is not None:
      hidden = hidden | (jnp.min(qpos) - jnp.max(kpos) > hi)
    return hidden

  def keep(self, ctx, extras, order: str = "bhgij", *, valid_queries: bool = False):
    """The block's kept pairs, a bool array over ``order`` (``b``, ``h`` (kv head), ``g``, ``i``, ``j``), size 1
    along axes nothing masks by.

    Args:
      ctx: the block's ``BlockContext``.
      extras: the extra buffers' blocks (``buffers`` order), canonical layouts.
      order: the axes of the result (a permutation of ``bhgij``).
      valid_queries: mask padding queries too (the backward's rows).
    """
    qpos, kpos = ctx.positions("i"), ctx.positions("j")
    keep = ctx.valid("j")[None, :]
    if valid_queries:
      keep = keep & ctx.valid("i")[:, None]
    lo, hi = self.band
    if lo is not None or hi is not None:
      d = qpos[:, None] - kpos[None, :]
      if lo is not None:
        keep = keep & (d >= lo)
      if hi is not None:
        keep = keep & (d <= hi)
    keep = keep[None, None, None]  # [1, 1, 1, i or 1, j]
    it = iter(extras)
    if self.segment_ids:
      qs, ks = next(it), next(it)
      keep = keep & (qs[:, None, None, :, None] == ks[:, None, None, None, :])
    if self.mask_axes is not None:
      keep = keep & expand_mask(next(it), self.mask_axes)
    return jnp.transpose(keep, ["bhgij".index(a) for a in order])

  def dense_keep(self, q_len: int, kv_len: int, extras) -> jnp.ndarray:
    """The kept pairs of a whole attention, bool [batch or 1, heads or 1, q_len, kv_len] (as
    ``jax.nn.dot_product_attention``'s ``mask``), from the program's extra inputs (``buffers`` order, the
    program's layouts: a mask's ``h`` is the query heads)."""
    d = jnp.arange(q_len)[:, None] - jnp.arange(kv_len)[None, :]
    lo, hi = self.band
    keep = jnp.ones((1, 1, q_len, kv_len), bool)
    if lo is not None:
      keep = keep & (d >= lo)
    if hi is not None:
      keep = keep & (d <= hi)
    it = iter(extras)
    if self.segment_ids:
      qs, ks = next(it), next(it)
      keep = keep & (qs[:, None, :, None] == ks[:, None, None, :])
    if self.mask_axes is not None:
      keep = keep & jnp.expand_dims(next(it), [n for n, a in enumerate(MASK_AXES) if a not in self.mask_axes])
    return keep

  # ------------------------------------------------------------------ the program's extra inputs
  def inputs(self, query, key, *, mask=None, query_seq_lengths=None, key_value_seq_lengths=None,
             q_segment_ids=None, kv_segment_ids=None, mask_axes=None, is_causal=None, local_window_size=None,
             bias=None, scale=None) -> tuple:
    """The program's extra input arrays (``buffers`` order) from the arguments ``attention_mask`` classified (the
    positional ones, ``is_causal`` and ``local_window_size``, and ``bias`` and ``scale`` are taken and not read)."""
    del is_causal, local_window_size, bias, scale  # in the program itself
    b, t = query.shape[0], query.shape[1]
    s = key.shape[1]
    out = []
    if self.segment_ids:
      out += [_segments(q_segment_ids, query_seq_lengths, b, t, PAD_QUERY_SEGMENT),
              _segments(kv_segment_ids, key_value_seq_lengths, b, s, _PAD_KEY)]
    if self.mask_axes is not None:
      dims, _ = _mask_dims(mask, mask_axes, query, key)
      out.append(jnp.reshape(jnp.asarray(mask), [size for size, a in dims if a in self.mask_axes]))
    return tuple(out)

  def arguments(self) -> dict:
    """The keyword arguments of ``jm.programs.attention`` that give a program this mask."""
    return dict(causal=self.causal, window=self.window, segment_ids=self.segment_ids, mask_axes=self.mask_axes)


def mask_of(params) -> AttentionMask:
  """The mask a program's parameters record (no mask for programs of other patterns)."""
  return AttentionMask(causal=bool(params.get("causal", False)), window=params.get("window"),
                       segment_ids=bool(params.get("segment_ids", False)), mask_axes=params.get("mask_axes"))


def expand_mask(block, axes):
  """A mask block over ``axes`` (``MASK_AXES`` names; ``h`` as its kv head and group) as [b, hk, g, i, j], size 1
  along the axes it lacks."""
  canonical = [a for a in SCORE_AXES if (a in ("hk", "g") and "h" in axes) or a in axes]
  return jnp.expand_dims(block, [n for n, a in enumerate(SCORE_AXES) if a not in canonical])


def _segments(ids, lengths, batch: int, n: int, pad: int):
  """int32 segment ids [batch, n]: ``ids`` (all 0 when None), ``pad`` past ``lengths``."""
  out = jnp.zeros((batch, n), jnp.int32) if ids is None else jnp.asarray(ids).astype(jnp.int32)
  if lengths is not None:
    out = jnp.where(jnp.arange(n)[None, :] < jnp.asarray(lengths)[:, None], out, pad)
  return out


# ------------------------------------------------------------------ static counts (no tracing)
def _pairs_at_or_below(queries: tuple[int, int], keys: tuple[int, int]) -> int:
  """How many (x, y) with x in ``queries``, y in ``keys`` (``[start, stop)`` ranges, any ints) have y <= x."""
  c, d = keys
  if d <= c:
    return 0

  def below(n):  # sum over x < n of the keys at or before x
    m = max(min(n, d) - c, 0)
    return m * (m + 1) // 2 + max(n - d, 0) * (d - c)

  return below(queries[1]) - below(queries[0])


def band_pairs(queries: tuple[int, int], keys: tuple[int, int], band) -> int:
  """How many (x, y) with x in ``queries``, y in ``keys`` (``[start, stop)``) have ``lo <= x - y <= hi``."""
  lo, hi = band
  total = max(queries[1] - queries[0], 0) * max(keys[1] - keys[0], 0)
  at_least = total if lo is None else _pairs_at_or_below((queries[0] - lo, queries[1] - lo), keys)
  above = 0 if hi is None else _pairs_at_or_below((queries[0] - hi - 1, queries[1] - hi - 1), keys)
  return at_least - above


def band_case(q_span: tuple[int, int], k_span: tuple[int, int], band) -> str:
  """``"visible"`` (the band keeps every pair), ``"hidden"`` (none) or ``"partial"``, for queries and keys whose
  smallest and largest positions are ``q_span`` and ``k_span``."""
  lo, hi = band
  (q_lo, q_hi), (k_lo, k_hi) = q_span, k_span
  d_min, d_max = q_lo - k_hi, q_hi - k_lo
  if (lo is not None and d_max < lo) or (hi is not None and d_min > hi):
    return "hidden"
  if (lo is None or d_min >= lo) and (hi is None or d_max <= hi):
    return "visible"
  return "partial"


# ------------------------------------------------------------------ classifying a call's arguments
def _shape(x, what: str):
  if x is None:
    return None
  if not hasattr(x, "shape"):
    raise MaskError(f"{what}: expected an array (or jax.ShapeDtypeStruct), got {type(x).__name__}")
  return tuple(x.shape)


def _mask_dims(mask, mask_axes, query, key) -> tuple[list[tuple[int, str]], tuple[int, ...]]:
  """``[(size, axis), ...]``: each dimension of the mask as ``attention_mask`` reads it, and the full sizes."""
  b, t, n = query.shape[0], query.shape[1], query.shape[2]
  s = key.shape[1]
  full = {"b": b, "h": n, "i": t, "j": s}
  shape = _shape(mask, "mask")
  if mask_axes is not None:
    axes = tuple(mask_axes)
    if len(axes) != len(shape) or any(a not in MASK_AXES for a in axes) or \
        list(axes) != sorted(axes, key=MASK_AXES.index) or len(set(axes)) != len(axes):
      raise MaskError(f"mask_axes {mask_axes!r} must name each of the mask's {len(shape)} dimensions, a subset of "
                      f"{MASK_AXES} in that order")
  else:
    if len(shape) > 4:
      raise MaskError(f"mask of shape {shape}: at most 4 dimensions, broadcastable to [batch, heads, q, kv]")
    axes = MASK_AXES[4 - len(shape):]  # jax.nn.dot_product_attention's leading 1s
  dims = list(zip(shape, axes))
  for size, a in dims:
    if size not in (1, full[a]):
      hint = ("; a [batch, q, kv] mask needs mask_axes=('b', 'i', 'j')" if mask_axes is None and len(shape) == 3
              and shape == (b, t, s) else "")
      raise MaskError(f"mask of shape {shape} (dims {list(axes)}): dimension {a!r} is {size}, which neither "
                      f"equals {full[a]} nor broadcasts (1){hint}")
  return dims, (b, n, t, s)


def attention_mask(query, key, *, mask=None, bias=None, is_causal: bool = False, local_window_size=None,
                   query_seq_lengths=None, key_value_seq_lengths=None, q_segment_ids=None, kv_segment_ids=None,
                   mask_axes=None, scale: Any = None) -> AttentionMask:
  """The ``AttentionMask`` of a ``jax.nn.dot_product_attention`` call, or ``MaskError`` saying why jaxmercury cannot
  express it.

  Arguments as ``jax.nn.dot_product_attention``'s (arrays or ``jax.ShapeDtypeStruct``s), plus:

  Args:
    query: [batch, q_len, heads, head_dim].
    key: [batch, kv_len, kv_heads, head_dim].
    mask: a boolean mask broadcastable to [batch, heads, q_len, kv_len] (fewer dimensions take leading 1s, as
      JAX's); see ``mask_axes``.
    bias: must be None (an additive bias is not expressible).
    is_causal, local_window_size, query_seq_lengths, key_value_seq_lengths: as JAX's. Sequence lengths become
      segment ids (padding queries and keys in segments no other position has).
    q_segment_ids, kv_segment_ids: int [batch, q_len] and [batch, kv_len]: a query keeps the keys of its own
      segment (packed sequences); give both or neither.
    mask_axes: which of ``("b", "h", "i", "j")`` the mask's dimensions are, in order (a Gemma-style mask
      [batch, q_len, kv_len] is ``("b", "i", "j")``); default JAX's reading.
    scale: must be None or ``1 / sqrt(head_dim)``, the programs' scale.

  Returns:
    The mask: ``jm.programs.attention(..., **mask.arguments())`` builds its program, ``mask.inputs(query, key,
    ...)`` (the same keyword arguments) the program's extra inputs, after q, k and v.

  Raises:
    MaskError: naming the argument and what would be expressible.
  """
  qs, ks = _shape(query, "query"), _shape(key, "key")
  if qs is None or ks is None or len(qs) != 4 or len(ks) != 4:
    raise MaskError(f"query {qs} and key {ks} must be 4-D: [batch, length, heads, head_dim]")
  b, t, _, d = qs
  s = ks[1]
  if bias is not None:
    raise MaskError("an additive bias: jaxmercury's attention programs take boolean masks, not biases")
  if scale is not None and not math.isclose(float(scale), 1 / math.sqrt(d), rel_tol=1e-6):
    raise MaskError(f"scale {scale}: jaxmercury's attention programs scale scores by 1/sqrt(head_dim) = "
                    f"{1 / math.sqrt(d):.6g}")
  window = None
  if local_window_size is not None:
    w = local_window_size
    if isinstance(w, (int, np.integer)) and not isinstance(w, bool):
      w = (int(w), int(w))
    window = w
  for name, x in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
    shape = _shape(x, name)
    if shape is not None and (shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer)):
      raise MaskError(f"{name}: expected int [batch] = [{b}], got {x.dtype} {shape}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise MaskError("segment ids: give q_segment_ids and kv_segment_ids together")
  for name, x, n in (("q_segment_ids", q_segment_ids, t), ("kv_segment_ids", kv_segment_ids, s)):
    shape = _shape(x, name)
    if shape is not None and (shape != (b, n) or not jnp.issubdtype(x.dtype, jnp.integer)):
      raise MaskError(f"{name}: expected int [batch, length] = [{b}, {n}], got {x.dtype} {shape}")
  axes = None
  if mask is not None:
    if np.dtype(mask.dtype) != np.bool_:
      raise MaskError(f"mask of dtype {mask.dtype}: a boolean mask is expressible (an additive one is a bias)")
    dims, full = _mask_dims(mask, mask_axes, query, key)
    sizes = dict(zip(MASK_AXES, full))
    axes = tuple(a for size, a in dims if size == sizes[a] and sizes[a] > 1)
    if not axes:
      raise MaskError(f"mask of shape {tuple(mask.shape)} masks no batch, head, query or key dimension; pass "
                      "is_causal or none")
  segments = q_segment_ids is not None or query_seq_lengths is not None or key_value_seq_lengths is not None
  return AttentionMask(causal=bool(is_causal), window=window, segment_ids=segments, mask_axes=axes)


def mask_reason(query, key, **kwargs) -> str | None:
  """Why ``attention_mask(query, key, **kwargs)`` is not expressible (None: it is)."""
  try:
    attention_mask(query, key, **kwargs)
  except MaskError as e:
    return str(e)
  return None
