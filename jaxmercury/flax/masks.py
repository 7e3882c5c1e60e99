"""What mask an attention pattern in a traced program applies, and whether a jaxmercury operator computes it.

A matched attention masks its logits with ``select_n(pred, fill, logits)``
(``jnp.where``). ``classify`` splits the predicate into the parts a logical
``and`` joins, or, for a mask of numbers (``jnp.where(a * b, ...)`` tests
``a * b != 0``), the factors a product joins (through the broadcasts,
transposes and reshapes that only place a part on the logits' dims), and
reads each part:

- *positional*: it depends on no input of the program (built from
  ``iota``/``tril``/constants). The positional parts are evaluated together
  at trace time and named: none, causal, sliding window; any other positional
  pattern is passed as a mask array.
- *segment ids*: an ``eq`` of integer arrays, one varying along the queries
  (and perhaps the batch), the other along the keys: those two arrays are
  the operator's ``q_segment_ids`` and ``kv_segment_ids``.
- *mask array*: any other boolean computed from the inputs: that value
  itself is the operator's ``mask``, over the logits dims it varies along
  (``mask_axes``).

``ROUTES`` maps a positional kind to the operator arguments that compute it;
data parts are ``Term``s whose arrays the rewrite reads. A part computed
from the attention's own scores (a top-k mask, say) cannot be passed: the
mask falls back to the program's own computation, with
``MaskInfo.describe()`` as the reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from jaxmercury.flax.jaxpr_view import DependsOnInputs, Lit, View

LARGEST_EVALUATED = 1 << 26  # elements of a mask evaluated at trace time
_CONE_LIMIT = 20000  # equations searched behind a mask part for the attention's own scores


@dataclasses.dataclass(frozen=True)
class Term:
  """A data part of a mask: arrays the operator reads.

  Attributes:
    kind: ``"segment_ids"`` (``refs``: the query-side and key-side ids) or ``"array"`` (``refs``: the boolean).
    refs: the program's values.
    dims: for each ref, the logits dim each of its dims lies along (None: a size-1 dim on none).
    note: more detail for the report.
    nonzero: an array of numbers, keeping where nonzero (a mask multiplied, ``jnp.where(a * b, ...)``).
    padding: an array varying along the keys (and the batch) alone: a padding mask (named so in reports).
  """

  kind: str
  refs: tuple
  dims: tuple
  note: str = ""
  nonzero: bool = False
  padding: bool = False


@dataclasses.dataclass(frozen=True)
class MaskInfo:
  """A mask on the logits of one attention.

  Attributes:
    kind: the positional part: ``"none"``, ``"causal"``, ``"sliding_window"`` (causal, a window back),
      ``"band"`` (``left`` keys back, ``right`` ahead); ``"unknown"`` where it cannot be routed (``note`` says why).
    params: what fixes it (``window`` for a sliding window: how many keys a query sees, itself included;
      ``left`` and ``right`` for a band).
    note: more detail for the report.
    terms: the data parts (segment ids, mask arrays), read when running.
  """

  kind: str
  params: tuple = ()
  note: str = ""
  terms: tuple = ()

  @property
  def name(self) -> str:
    """The kinds of its parts, ``+``-joined (``causal+segment_ids``; an array that is a padding mask:
    ``padding``); ``none`` for no mask."""
    parts = ([self.kind] if self.kind != "none" else []) + ["padding" if t.padding else t.kind for t in self.terms]
    return "+".join(dict.fromkeys(parts)) or "none"

  def describe(self) -> str:
    words = {"none": "no mask", "causal": "causal mask", "sliding_window": "sliding-window mask",
             "band": "two-sided window", "segment_ids": "segment-id mask", "array": "mask array",
             "padding": "padding mask", "unknown": "mask"}
    extra = ", ".join(f"{k}={v}" for k, v in self.params)
    text = " and ".join(words[p] for p in self.name.split("+"))
    notes = [n for n in (self.note, *(t.note for t in self.terms)) if n]
    return text + (f" ({extra})" if extra else "") + (f": {'; '.join(notes)}" if notes else "")


# positional kind -> operator arguments (``ops.attention`` keywords) computing it
ROUTES: dict[str, Callable[[MaskInfo], dict]] = {
    "none": lambda info: {"causal": False},
    "causal": lambda info: {"causal": True},
    # a query sees ``window`` keys, itself included: ``local_window_size`` (window - 1, 0), causal
    "sliding_window": lambda info: {"causal": True, "window": (dict(info.params)["window"] - 1, 0)},
    # a query sees ``left`` keys before it and ``right`` after it
    "band": lambda info: {"causal": False, "window": (dict(info.params)["left"], dict(info.params)["right"])},
}


def kept_pairs(info: MaskInfo, s: int, t: int, xp=np):
  """The ``[s, t]`` (query, key) pairs ``info``'s positional part keeps (``ROUTES``' semantics), computed with
  ``xp`` (``numpy``, or ``jax.numpy`` inside a program: from iotas, no constant of ``s * t`` elements)."""
  i, j = xp.arange(s)[:, None], xp.arange(t)[None, :]
  p = dict(info.params)
  if info.kind == "causal":
    return j <= i
  if info.kind == "sliding_window":
    return (j <= i) & (i - j < p["window"])
  if info.kind == "band":
    return (i - j <= p["left"]) & (j - i <= p["right"])
  return xp.ones((s, t), bool)


def route(info: MaskInfo) -> dict | None:
  """The operator arguments computing ``info``'s positional part; None where no operator computes the mask."""
  build = ROUTES.get(info.kind)
  return None if build is None else build(info)


# ------------------------------------------------------------------ following a value to where it is made
def _back(view: View, ref, dims: tuple, *, ints: bool = False, numbers: bool = False):
  """``ref`` (its dims on the logits dims ``dims``) without the broadcasts, transposes, size-1 reshapes and
  same-kind casts that only place it; ``ints``: follow integer casts (segment ids), ``numbers``: numeric ones (a
  mask made of numbers), else boolean ones."""
  for _ in range(64):
    site = view.producer(ref)
    if site is None:
      return ref, dims
    p = site.primitive
    if p == "broadcast_in_dim":
      ref, dims = site.ins[0], tuple(dims[d] for d in site.params["broadcast_dimensions"])
    elif p == "transpose":
      perm = site.params["permutation"]
      inv = [None] * len(perm)
      for i, src in enumerate(perm):
        inv[src] = dims[i]
      ref, dims = site.ins[0], tuple(inv)
    elif p in ("convert_element_type", "copy", "squeeze", "reshape", "expand_dims"):
      src = View.aval(site.ins[0])
      kind = (np.issubdtype(src.dtype, np.integer) if ints else src.dtype != np.bool_ if numbers
              else src.dtype == np.bool_)
      if not kind:
        return ref, dims
      if p in ("convert_element_type", "copy"):
        ref = site.ins[0]
        continue
      out_shape = View.aval(ref).shape
      big_out = [d for d, n in enumerate(out_shape) if n != 1]
      big_in = [d for d, n in enumerate(src.shape) if n != 1]
      if [out_shape[d] for d in big_out] != [src.shape[d] for d in big_in]:
        return ref, dims
      new = [None] * len(src.shape)
      for i, o in zip(big_in, big_out):
        new[i] = dims[o]
      ref, dims = site.ins[0], tuple(new)
    else:
      return ref, dims
  return ref, dims


def _parts(view: View, ref, dims: tuple, out: list, nonzero: bool = False):
  """The parts an ``and`` of booleans joins in ``ref``, each ``(ref, dims, nonzero)``; masks made of numbers
  too (``jnp.where(a * b, ...)`` tests ``a * b != 0``: the parts a product joins, each kept where it is
  nonzero, ``nonzero`` True)."""
  ref, dims = _back(view, ref, dims, numbers=nonzero)
  site = view.producer(ref)
  if site is None:
    out.append((ref, dims, nonzero))
  elif nonzero and site.primitive == "convert_element_type" and View.aval(site.ins[0]).dtype == np.bool_:
    _parts(view, site.ins[0], dims, out)  # a boolean made a number
  elif not nonzero and site.primitive == "ne" and _zero_test(view, site) is not None:
    _parts(view, _zero_test(view, site), dims, out, nonzero=True)
  elif (not nonzero and site.primitive == "convert_element_type" and View.aval(ref).dtype == np.bool_
        and View.aval(site.ins[0]).dtype != np.bool_):
    _parts(view, site.ins[0], dims, out, nonzero=True)  # a number's truth (Flax's float masks cast back)
  elif site.primitive == ("mul" if nonzero else "and") and len(site.ins) == 2 and (
      nonzero or View.aval(ref).dtype == np.bool_):
    for r in site.ins:
      if isinstance(r, Lit):
        value = np.asarray(r.value)
        if not (value != 0 if nonzero else value.astype(bool)).all():
          out.append((r, (), nonzero))
        continue
      _parts(view, r, dims, out, nonzero)
  else:
    out.append((ref, dims, nonzero))


def _zero_test(view: View, site):
  """The number an ``ne`` compares with zero (``jnp.where``'s test of a numeric mask); None otherwise."""
  a, b = site.ins
  for x, zero in ((a, b), (b, a)):
    if View.aval(x).dtype != np.bool_ and view.scalar(x) is None and view.scalar(zero) == 0:
      return x
  return None


def _varies(ref, dims) -> set:
  """The logits dims along which ``ref`` varies (its dims of size above 1)."""
  return {d for d, n in zip(dims, View.aval(ref).shape) if n != 1}


def _uses(view: View, ref, avoid: set) -> bool:
  """Whether ``ref`` is computed from an equation in ``avoid`` (ids)."""
  seen, todo = set(), [ref]
  while todo and len(seen) < _CONE_LIMIT:
    r = todo.pop()
    if isinstance(r, Lit) or r in seen:
      continue
    seen.add(r)
    site = view.producer(r)
    if site is None:
      continue
    if id(site) in avoid:
      return True
    todo.extend(site.ins)
  return len(seen) >= _CONE_LIMIT


def _segments(view: View, ref, dims, q_dim, k_dim, batch_dim) -> Term | None:
  """The segment-id term of an ``eq`` of integer arrays, one along the queries and one along the keys."""
  site = view.producer(ref)
  if site is None or site.primitive != "eq" or len(site.ins) != 2:
    return None
  if not all(np.issubdtype(View.aval(x).dtype, np.integer) for x in site.ins):
    return None
  sides = [_back(view, x, dims, ints=True) for x in site.ins]
  if any(isinstance(r, Lit) for r, _ in sides):
    return None
  spans = [_varies(r, d) for r, d in sides]
  if spans[0] and k_dim in spans[0]:
    sides, spans = sides[::-1], spans[::-1]
  (qr, qd), (kr, kd) = sides
  if not (q_dim in spans[0] and spans[0] <= {q_dim, batch_dim} and k_dim in spans[1]
          and spans[1] <= {k_dim, batch_dim}):
    return None
  return Term("segment_ids", (qr, kr), (qd, kd))


def classify(view: View, preds: list, q_dim: int | None, k_dim: int, rank: int, shape: tuple, *,
             batch_dim: int | None = None, scores: frozenset = frozenset()) -> MaskInfo:
  """The mask that ``preds`` (``(pred_ref, dims, keep_where_true)``: each predicate with the logits dims its
  dims are and whether ``True`` keeps a logit) apply to logits of ``shape``; ``q_dim``, ``k_dim`` and
  ``batch_dim`` are the logits' query, key and batch dims (``q_dim`` None: not known yet); ``scores``: the ids of
  the equations computing the logits (a part computed from them cannot be passed)."""
  if not preds:
    return MaskInfo("none")
  full, terms, positional = None, [], []
  for ref, dims, keep in preds:
    if not keep:  # where(~keep, fill, logits)
      bare, bare_dims = _back(view, ref, dims)
      site = view.producer(bare)
      if site is not None and site.primitive == "not":
        ref, dims, keep = site.ins[0], bare_dims, True
    parts = []
    _parts(view, ref, dims, parts)
    if not keep and len(parts) > 1:  # masked where an ``and`` holds: its parts do not separate
      parts = [(*_back(view, ref, dims), False)]
    for part, pdims, nonzero in parts:
      size = math.prod(View.aval(part).shape)
      try:
        if size > LARGEST_EVALUATED:
          raise DependsOnInputs
        value = np.asarray(view.evaluate(part))
        value = value != 0 if nonzero else value.astype(bool)
      except DependsOnInputs:
        if scores and _uses(view, part, scores):
          return MaskInfo("unknown", note="computed from the attention's own scores")
        if not keep:
          return MaskInfo("unknown", note="a mask computed from the inputs, True where masked")
        seg = None if q_dim is None or nonzero or any(t.kind == "segment_ids" for t in terms) else \
            _segments(view, part, pdims, q_dim, k_dim, batch_dim)
        spans = _varies(part, pdims)
        padding = k_dim in spans and spans <= {k_dim, batch_dim}
        terms.append(seg or Term("array", (part,), (pdims,), "computed from the inputs", nonzero, padding))
        continue
      positional.append((part, pdims, nonzero))
      if not keep:
        value = ~value
      # onto the logits' dims, size 1 where the mask does not vary
      placed = np.ones([1] * rank, bool)
      if pdims:
        order = [d for d in range(len(pdims))]
        value = value.reshape(View.aval(part).shape)
        keep_dims = [i for i in order if pdims[i] is not None]
        value = value.reshape([value.shape[i] for i in keep_dims]) if len(keep_dims) != len(order) else value
        tgt = [pdims[i] for i in keep_dims]
        value = np.transpose(value, np.argsort(tgt))
        ordered = sorted(tgt)
        placed = value.reshape([value.shape[ordered.index(d)] if d in ordered else 1 for d in range(rank)])
      else:
        placed = placed & bool(np.asarray(value).all())
      full = placed if full is None else full & placed
  info = MaskInfo("none", terms=tuple(terms))
  if full is None:
    return info
  as_array = dataclasses.replace(info, terms=tuple(terms) + tuple(
      Term("array", (r,), (d,), "a constant mask", nz) for r, d, nz in positional if _varies(r, d)))
  for d in range(rank):
    if d not in (q_dim, k_dim) and full.shape[d] > 1:
      if not np.all(full == full.take([0], axis=d)):
        return as_array
      full = full.take([0], axis=d)
  if q_dim is None:
    return as_array
  m = np.broadcast_to(full, [shape[d] if d in (q_dim, k_dim) else 1 for d in range(rank)])
  m = m.reshape(shape[q_dim], shape[k_dim]) if q_dim < k_dim else m.reshape(shape[k_dim], shape[q_dim]).T
  kind = classify_matrix(m)
  if kind.kind == "array":
    return as_array
  return dataclasses.replace(kind, terms=tuple(terms))


def classify_matrix(m: np.ndarray) -> MaskInfo:
  """The kind of a ``[q, k]`` boolean mask (True: the key is seen); ``array`` where it is none of the
  positional kinds."""
  s, t = m.shape
  if m.all():
    return MaskInfo("none")
  i, j = np.arange(s)[:, None], np.arange(t)[None, :]
  if np.array_equal(m, j <= i):
    return MaskInfo("causal")
  seen = m.sum(axis=1)
  w = int(seen.max()) if seen.size else 0
  if w and np.array_equal(m, (j <= i) & (i - j < w)):
    return MaskInfo("sliding_window", (("window", w),))
  d = i - j  # a band lo <= query - key <= hi (Gemma's two-sided local mask)
  if m.any() and d[m].min() <= 0 <= d[m].max():
    lo, hi = int(d[m].min()), int(d[m].max())
    if np.array_equal(m, (d >= lo) & (d <= hi)):
      return MaskInfo("band", (("left", hi), ("right", -lo)))
  return MaskInfo("array", note="not causal, a sliding window or a band")


# ------------------------------------------------------------------ the operator's arguments for the data parts
def term_axes(term: Term, roles: dict) -> tuple[str, ...]:
  """The ``mask_axes`` (of ``b``, ``h``, ``i``, ``j``) an array term varies along; ``roles``: logits dim -> axis."""
  (ref,), (dims,) = term.refs, term.dims
  present = {roles[d] for d in _varies(ref, dims)}
  return tuple(a for a in ("b", "h", "i", "j") if a in present)


def mask_axes(info: MaskInfo, roles: dict) -> tuple[str, ...] | None:
  """The ``mask_axes`` of the operator's one mask array (the array terms joined); None without one."""
  arrays = [t for t in info.terms if t.kind == "array"]
  if not arrays:
    return None
  present = set().union(*(term_axes(t, roles) for t in arrays))
  return tuple(a for a in ("b", "h", "i", "j") if a in present)


def has_segments(info: MaskInfo) -> bool:
  return any(t.kind == "segment_ids" for t in info.terms)
