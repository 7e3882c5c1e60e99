"""What mask an attention pattern in a traced program applies, and whether a jaxmercury operator computes it.

A matched attention masks its logits with ``select_n(pred, fill, logits)``
(``jnp.where``). ``classify`` evaluates the predicate where it depends on no
input of the program (masks built from ``iota``/``tril``/constants: causal,
sliding window) and names it; a predicate computed from the inputs is a
segment-id mask (an ``eq`` of integer inputs) or a mask array.

``ROUTES`` maps a mask kind to the operator arguments that compute it; a kind
missing from it (segment ids and mask arrays: their operators take the mask's
arrays as inputs, which the rewrite does not pass yet) falls back to the
program's own computation, with its ``MaskInfo.describe()`` as the reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from jaxmercury.flax.jaxpr_view import DependsOnInputs, Lit, View

LARGEST_EVALUATED = 1 << 26  # elements of a mask evaluated at trace time


@dataclasses.dataclass(frozen=True)
class MaskInfo:
  """A mask on the logits of one attention.

  Attributes:
    kind: ``"none"``, ``"causal"``, ``"sliding_window"``, ``"segment_ids"``, ``"array"`` or ``"unknown"``.
    params: what fixes it (``window`` for a sliding window: how many keys a query sees, itself included).
    note: more detail for the report.
  """

  kind: str
  params: tuple = ()
  note: str = ""

  def describe(self) -> str:
    extra = ", ".join(f"{k}={v}" for k, v in self.params)
    words = {"none": "no mask", "causal": "causal mask", "sliding_window": "sliding-window mask",
             "segment_ids": "segment-id mask", "array": "mask array", "unknown": "mask"}[self.kind]
    return words + (f" ({extra})" if extra else "") + (f": {self.note}" if self.note else "")


# kind -> operator arguments (``ops.attention`` keywords) computing it
ROUTES: dict[str, Callable[[MaskInfo], dict]] = {
    "none": lambda info: {"causal": False},
    "causal": lambda info: {"causal": True},
    # a query sees ``window`` keys, itself included: ``local_window_size`` (window - 1, 0), causal
    "sliding_window": lambda info: {"causal": True, "window": (dict(info.params)["window"] - 1, 0)},
}


def route(info: MaskInfo) -> dict | None:
  """The operator arguments computing ``info``'s mask; None where no operator computes it."""
  build = ROUTES.get(info.kind)
  return None if build is None else build(info)


def _peel(view: View, ref, dims: tuple):
  """``ref`` (whose dims are ``dims`` of the logits) without the broadcasts and all-true conjunctions around it."""
  for _ in range(32):
    site = view.producer(ref)
    if site is None:
      return ref, dims
    if site.primitive == "broadcast_in_dim":
      ref, dims = site.ins[0], tuple(dims[d] for d in site.params["broadcast_dimensions"])
    elif site.primitive in ("convert_element_type", "copy"):
      ref = site.ins[0]
    elif site.primitive == "and" and len(site.ins) == 2:
      a, b = site.ins
      if view.scalar(a) is True or view.scalar(a) == 1:
        ref = b
      elif view.scalar(b) is True or view.scalar(b) == 1:
        ref = a
      else:
        return ref, dims
    else:
      return ref, dims
  return ref, dims


def _from_inputs(view: View, ref) -> MaskInfo:
  """A mask computed from the program's inputs: segment ids where it compares integers, else a mask array."""
  seen, todo = set(), [ref]
  while todo:
    r = todo.pop()
    if isinstance(r, Lit) or r in seen:
      continue
    seen.add(r)
    site = view.producer(r)
    if site is None:
      continue
    if site.primitive == "eq" and all(np.issubdtype(View.aval(x).dtype, np.integer) for x in site.ins):
      return MaskInfo("segment_ids", note="computed from the inputs")
    todo.extend(site.ins)
  return MaskInfo("array", note="computed from the inputs")


def classify(view: View, preds: list, q_dim: int | None, k_dim: int, rank: int, shape: tuple) -> MaskInfo:
  """The mask that ``preds`` (``(pred_ref, dims, keep_where_true)``: each predicate with the logits dims its
  dims are and whether ``True`` keeps a logit) apply to logits of ``shape``; ``q_dim`` and ``k_dim`` are the
  logits' query and key dims (``q_dim`` None: not known yet)."""
  if not preds:
    return MaskInfo("none")
  full = None
  for ref, dims, keep in preds:
    ref, dims = _peel(view, ref, dims)
    size = math.prod(View.aval(ref).shape)
    if size > LARGEST_EVALUATED:
      return MaskInfo("unknown", note=f"{size} elements, too large to inspect")
    try:
      value = np.asarray(view.evaluate(ref), bool)
    except DependsOnInputs:
      return _from_inputs(view, ref)
    if not keep:
      value = ~value
    # onto the logits' dims, size 1 where the mask does not vary
    value = np.transpose(value.reshape(View.aval(ref).shape), np.argsort(dims))
    ordered = sorted(dims)
    placed = value.reshape([value.shape[ordered.index(d)] if d in ordered else 1 for d in range(rank)])
    full = placed if full is None else full & placed
  others = [d for d in range(rank) if d not in (q_dim, k_dim)]
  for d in others:
    if full.shape[d] > 1:
      if not np.all(full == full.take([0], axis=d)):
        return MaskInfo("array", note="varies by batch or head")
      full = full.take([0], axis=d)
  if q_dim is None:
    return MaskInfo("array", note="the query dimension is not known")
  m = np.broadcast_to(full, [shape[d] if d in (q_dim, k_dim) else 1 for d in range(rank)])
  m = m.reshape(shape[q_dim], shape[k_dim]) if q_dim < k_dim else m.reshape(shape[k_dim], shape[q_dim]).T
  return classify_matrix(m)


def classify_matrix(m: np.ndarray) -> MaskInfo:
  """The kind of a ``[q, k]`` boolean mask (True: the key is seen)."""
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
  return MaskInfo("array", note="not causal or a sliding window")
