"""Attention and GEMMs found in a traced program.

``find(view, devices)`` returns one ``Match`` for each attention and each
contraction of the program:

- attention: ``dot_general`` (queries . keys) -> the code models write
  between the scores and the softmax (``LOGITS_CASES``: casts, a scale,
  transposes, grouped heads merged by a reshape, masks as ``select_n`` with
  a large negative fill; a soft cap and a bias are read and reported) ->
  softmax (``exp(x - max x) / sum``) -> the code between the softmax and
  the values (``WEIGHTS_CASES``: casts, transposes, grouped heads split
  again, a dropout, routed at rate 0) -> ``dot_general`` (. values), in any
  dimension order, with grouped key-value heads (a query operand with more
  free dimensions than the sequence, or heads merged around the softmax)
  or without. What ``jnp.einsum`` attention (Flax's Gemma example),
  ``flax.nnx.dot_product_attention`` and ``jax.nn.dot_product_attention``'s
  XLA implementation trace to. A softmax between two batched products with
  code no case reads is reported as attention with that code as its reason.
- attention through cuDNN: the primitive ``jax.nn.dot_product_attention(...,
  implementation="cudnn")`` traces to (``CUDNN_ATTENTION``, inside the
  ``custom_vjp_call`` of JAX's cuDNN attention), with its causal mask,
  sliding window, scale, and a boolean mask passed as its bias (read back to
  the boolean through the ``select_n`` that made the bias).
- matmul: any other ``dot_general``; a GEMM where it has no batch dims.

A ``Match`` records the labelled dimensions of each operand so that the
rewriter can bring them to an operator's layout and its result back; where
no operator applies it carries the reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.flax import masks
from jaxmercury.flax.jaxpr_view import Site, View, source_line

NEGATIVE_FILL = -1e4  # a masked logit's fill is at most this
# JAX's cuDNN flash attention forward (its module ``cudnn.fused_attention_stablehlo``), the primitive that carries
# its batching and partitioning rules; its operands: query, key, value, bias, q_seqlen, kv_seqlen, q_offsets,
# kv_offsets, page tables.
CUDNN_ATTENTION = "dot_product_attention_fwd_wrapper"
_PASS = ("convert_element_type", "copy", "reduce_precision", "reshard", "sharding_constraint")


@dataclasses.dataclass(eq=False)
class Match:
  """One attention or contraction of the program.

  Attributes:
    kind: ``"attention"`` or ``"matmul"``.
    anchor: the equation whose result the operator gives (the values product, or the dot_general).
    inner: the equations the operator replaces, besides the anchor (none of their results is used elsewhere).
    where: the source line that made it.
    reason: why it cannot be routed (empty when it can).
    operands: attention: the ``(query, key, value)`` references; matmul: ``(lhs, rhs)``.
    layout: attention: each operand's dims in operator order (see ``_attention``) and the result's; matmul:
      the operands' permutations to ``[free, contracted]`` and ``[contracted, free]``.
    scale: the logits' scale (attention).
    mask: the mask (attention).
  """

  kind: str
  anchor: Site
  inner: tuple = ()
  where: str = ""
  reason: str = ""
  operands: tuple = ()
  layout: dict = dataclasses.field(default_factory=dict)
  scale: float = 1.0
  mask: masks.MaskInfo | None = None

  @property
  def shapes(self) -> tuple:
    if "shapes" in self.layout:
      return self.layout["shapes"]
    return tuple(tuple(View.aval(r).shape) for r in self.operands)

  @property
  def dtype(self):
    return View.aval(self.operands[0]).dtype if self.operands else None


def find(view: View) -> list[Match]:
  """Every attention and contraction of ``view``'s program, in program order."""
  found, taken = [], set()
  for site in view.sites:
    if site.primitive == CUDNN_ATTENTION:
      found.append(_cudnn_attention(view, site))
      taken.add(id(site))
    if site.primitive == "exp":
      m = _attention(view, site) or _unread(view, site)
      if m is not None and not (taken & {id(s) for s in (m.anchor, *m.inner)}):
        found.append(m)
        taken |= {id(s) for s in (m.anchor, *m.inner)}
  for site in view.sites:
    if site.primitive == "dot_general" and id(site) not in taken:
      found.append(_matmul(view, site))
  order = {id(s): i for i, s in enumerate(view.sites)}
  return sorted(found, key=lambda m: order[id(m.anchor)])


# ------------------------------------------------------------------ attention
def _reaches_max(view, ref) -> list | None:
  """The equations from ``ref`` back to a ``reduce_max`` over one axis (broadcasts, casts, transposes,
  stop_gradient, a max with -inf), that reduce_max last; None when it is not that."""
  chain = []
  for _ in range(10):
    site = view.producer(ref)
    if site is None:
      return None
    chain.append(site)
    if site.primitive == "reduce_max":
      return chain if len(site.params["axes"]) == 1 else None
    if site.primitive in ("broadcast_in_dim", "stop_gradient", "reshape", "transpose", *_PASS):
      ref = site.ins[0]
    elif site.primitive == "max":
      other = [r for r in site.ins if view.scalar(r) is None]
      if len(other) != 1:
        return None
      ref = other[0]
    else:
      return None
  return None


def _softmax(view, exp):
  """``(logits, axis, probs, sites)`` when ``exp`` is a softmax's exponential over one axis; else None.

  The maximum may be taken over the logits before a transpose (XLA's ``jax.nn.softmax`` of a transposed
  array): the transpose must bring the maximum's axis to the sum's."""
  sub = view.producer(exp.ins[0])
  if sub is None or sub.primitive != "sub":
    return None
  logits = sub.ins[0]
  to_max = _reaches_max(view, sub.ins[1])
  if to_max is None:
    return None
  rmax = to_max[-1]
  e = exp.outs[0]
  for div in view.consumers(e):
    if div.primitive != "div" or div.ins[0] != e:
      continue
    ref, chain = div.ins[1], []
    for _ in range(6):
      site = view.producer(ref)
      if site is None:
        break
      chain.append(site)
      if site.primitive == "reduce_sum":
        axes = tuple(site.params["axes"])
        if site.ins[0] != e or len(axes) != 1:
          break
        if rmax.ins[0] != logits:
          t = view.producer(logits)
          if t is None or t.primitive != "transpose" or t.ins[0] != rmax.ins[0] \
              or t.params["permutation"][axes[0]] != rmax.params["axes"][0]:
            break
        elif tuple(rmax.params["axes"]) != axes:
          break
        return logits, axes[0], div.outs[0], (sub, exp, div, *to_max, *chain)
      if site.primitive not in ("broadcast_in_dim", "reshape", *_PASS):
        break
      ref = site.ins[0]
  return None


# ------------------------------------------------------------------ attention: the code between its products
@dataclasses.dataclass
class _Walk:
  """A walk from the scores product to the softmax (``logits`` side) or from the softmax to the values product
  (``weights`` side).

  Attributes:
    labels: for each dim of the value reached, the scores product's result dims it holds, major first (a reshape
      merges or splits them).
    sizes: each scores-product dim's size.
    scale: the product of the scalars the logits are multiplied by (logits side) or the weights (weights side).
    preds: the masks met: ``(pred, labels of its dims, keep_where_true)``.
    reasons: why the operator does not compute it, in the order met.
    dropout: the dropout rate met on the weights (None: none).
  """

  labels: list
  sizes: dict
  scale: float = 1.0
  preds: list = dataclasses.field(default_factory=list)
  reasons: list = dataclasses.field(default_factory=list)
  dropout: float | None = None


@dataclasses.dataclass(frozen=True)
class Case:
  """One form of code between attention's two products that the matcher reads.

  Attributes:
    name: what it is.
    primitives: the primitives it matches.
    follow: ``follow(view, site, ref) -> ref | None``: the next value of the walk, or None where ``site`` is not
      this case. On the logits side the walk goes back from ``ref``, a result of ``site``: the next value is the
      operand leading to the scores product. On the weights side it goes on from ``ref``, an operand of ``site``:
      the next value is its result.
    apply: ``apply(view, site, walk, operand) -> bool``: the case's effect on ``walk`` (dims, scale, masks,
      reasons), ``operand`` being the operand of ``site`` the walk passes through, from the scores product's
      side; False where the walk cannot go on.
    written_by: the model code that writes it (each case has its test, built from that code).
  """

  name: str
  primitives: tuple
  follow: Callable
  apply: Callable
  written_by: str


def _first(view, site, ref):
  return site.ins[0]


def _result(view, site, ref):
  return site.outs[0] if site.ins and site.ins[0] == ref else None


def _nothing(view, site, walk, operand) -> bool:
  return True


def _scalar_operand(view, site, ref, back: bool):
  """``(operand the walk follows, the scalar)`` of a ``mul``/``div`` by one number; None otherwise (a ``div``
  only by a scalar divisor)."""
  a, b = site.ins
  if back:
    if site.primitive == "mul" and view.scalar(a) is not None:
      return b, view.scalar(a)
    return (a, view.scalar(b)) if view.scalar(b) is not None else None
  if a == ref and view.scalar(b) is not None:
    return a, view.scalar(b)
  if site.primitive == "mul" and b == ref and view.scalar(a) is not None:
    return b, view.scalar(a)
  return None


def _scale_follow(back: bool):
  def follow(view, site, ref):
    found = _scalar_operand(view, site, ref, back)
    if found is None:
      return None
    return found[0] if back else site.outs[0]
  return follow


def _scale(view, site, walk, operand) -> bool:
  c = _scalar_operand(view, site, operand, back=False)[1]
  walk.scale = walk.scale * c if site.primitive == "mul" else walk.scale / c
  return True


def _transpose(view, site, walk, operand) -> bool:
  walk.labels = [walk.labels[p] for p in site.params["permutation"]]
  return True


def _regroup(view, site, walk, operand) -> bool:
  """A reshape that merges neighbouring dims or splits a merged dim back into its parts."""
  atoms = [a for label in walk.labels for a in label]
  out, i = [], 0
  for n in site.params["new_sizes"]:
    group, size = [], 1
    while size < n and i < len(atoms):
      group.append(atoms[i])
      size *= walk.sizes[atoms[i]]
      i += 1
    if size != n:
      return False
    out.append(tuple(group))
  while i < len(atoms) and walk.sizes[atoms[i]] == 1 and out:
    out[-1] += (atoms[i],)
    i += 1
  if i != len(atoms):
    return False
  walk.labels = out
  return True


def _fill(view, ref) -> bool:
  value = view.scalar(ref)
  return value is not None and value <= NEGATIVE_FILL


def _mask_follow(view, site, ref):
  if len(site.ins) != 3:
    return None
  _, case0, case1 = site.ins
  return case1 if _fill(view, case0) else case0 if _fill(view, case1) else None


def _mask(view, site, walk, operand) -> bool:
  pred, case0, _ = site.ins
  walk.preds.append((pred, list(walk.labels), _fill(view, case0)))
  return True


def _cap(view, site, walk, operand) -> bool:
  walk.reasons.append("a soft cap (tanh) on the logits: no operator computes it")
  return True


def _bias_follow(view, site, ref):
  for r in site.ins:
    if _reaches_scores(view, r):
      return r
  return None


def _bias(view, site, walk, operand) -> bool:
  walk.reasons.append("adds a bias to the logits")
  return True


def _keep_probability(view, ref):
  """The keep probability of a dropout mask (``bernoulli(key, p) = uniform(key) < p``, perhaps cast, broadcast
  and divided by ``p``); None where ``ref`` is not one."""
  for _ in range(8):
    site = view.producer(ref)
    if site is None:
      return None
    scaled = site.primitive == "div" and view.scalar(site.ins[1]) is not None
    if scaled or site.primitive in ("convert_element_type", "broadcast_in_dim", "reshape", *_PASS):
      ref = site.ins[0]
    elif site.primitive == "lt" and view.scalar(site.ins[1]) is not None and view.scalar(site.ins[0]) is None:
      return float(view.scalar(site.ins[1]))
    else:
      return None
  return None


def _dropout_follow(view, site, ref):
  if site.primitive == "mul" and ref in site.ins and all(view.scalar(r) is None for r in site.ins):
    return site.outs[0]
  if site.primitive == "select_n" and len(site.ins) == 3 and site.ins[2] == ref and view.scalar(site.ins[1]) == 0:
    return site.outs[0]
  return None


def _dropout(view, site, walk, operand) -> bool:
  keep = site.ins[0] if site.primitive == "select_n" else next(r for r in site.ins if r != operand)
  p = _keep_probability(view, keep)
  if p is None:
    walk.reasons.append("the attention weights are multiplied by an array after the softmax")
  elif p < 1:
    walk.dropout = 1 - p
    walk.reasons.append(f"dropout on the attention weights (rate {1 - p:g}): no operator computes it")
  return True  # a keep probability of 1 (rate 0) keeps every weight


_CASTS = "dtype casts (jax.nn.dot_product_attention's float32 logits, .astype), reshards, sharding constraints"
_GROUPED = ("Gemma 3's grouped heads (examples/gemma/modules.py: logits.reshape((B, T, num_heads, -1)) after "
            "einsum('BTKGH,BSKH->BTKGS'), probs.reshape((B, T, K, G, -1)) before einsum('BTKGS,BSKH->BTKGH')); "
            "flax.nnx.dot_product_attention's grouped-query weights")
LOGITS_CASES = (
    Case("cast", _PASS, _first, _nothing, _CASTS),
    Case("scale", ("mul", "div"), _scale_follow(back=True), _scale,
         "the logits scaled (flax.nnx.dot_product_attention's q / sqrt(d) as logits * c)"),
    Case("transpose", ("transpose",), _first, _transpose, "jnp.einsum's result order"),
    Case("grouped heads", ("reshape",), _first, _regroup, _GROUPED),
    Case("mask", ("select_n",), _mask_follow, _mask, "jnp.where(mask, logits, large negative): every mask"),
    Case("soft cap", ("tanh",), _first, _cap, "Gemma 2's jnp.tanh(logits / cap) * cap"),
    Case("bias", ("add",), _bias_follow, _bias, "jax.nn.dot_product_attention(bias=), position biases"),
)
WEIGHTS_CASES = (
    Case("cast", _PASS, _result, _nothing, _CASTS),
    Case("transpose", ("transpose",), _result, _transpose, "jnp.einsum's operand order"),
    Case("grouped heads", ("reshape",), _result, _regroup, _GROUPED),
    Case("scale", ("mul", "div"), _scale_follow(back=False), _scale, "a dropout's 1 / keep probability"),
    Case("dropout", ("mul", "select_n"), _dropout_follow, _dropout,
         "flax.nnx.dot_product_attention_weights' weights * keep / keep_prob, nnx.Dropout's select(keep, x / "
         "keep_prob, 0); at rate 0 (keep probability 1) every weight is kept"),
)
_LONGEST = 24  # equations between a product and the softmax


def _step(cases, view, site, ref):
  """``(case, next value)`` of the first case that reads ``site`` reached at ``ref``; None where none does."""
  for case in cases:
    if site.primitive in case.primitives:
      nxt = case.follow(view, site, ref)
      if nxt is not None:
        return case, nxt
  return None


def _back_to_scores(view, ref):
  """``(scores product, [(case, site, operand)] from it to ``ref``)``; None where ``ref`` is not reached from a
  ``dot_general`` through the logits cases."""
  chain = []
  for _ in range(_LONGEST):
    site = view.producer(ref)
    if site is None:
      return None
    if site.primitive == "dot_general":
      return site, chain[::-1]
    step = _step(LOGITS_CASES, view, site, ref)
    if step is None:
      return None
    chain.append((step[0], site, step[1]))
    ref = step[1]
  return None


def _reaches_scores(view, ref) -> bool:
  return _back_to_scores(view, ref) is not None


def _on_to_values(view, probs, walk):
  """``(values product, [sites])`` from the softmax's result ``probs`` through the weights cases (applied to
  ``walk``), the product's operand; None where it is not reached."""
  ref, sites = probs, []
  for _ in range(_LONGEST):
    users = view.consumers(ref)
    dots = [u for u in users if u.primitive == "dot_general"]
    if len(users) == 1 and not dots:
      step = _step(WEIGHTS_CASES, view, users[0], ref)
      if step is None or not step[0].apply(view, users[0], walk, ref):
        return None
      sites.append(users[0])
      ref = step[1]
      continue
    return (dots[0], sites, ref) if len(dots) == 1 else None
  return None


def _dot_labels(dn, ranks):
  """The labels of a dot_general's result dims: ``("b", i)`` for its i-th batch pair, ``(0, d)`` / ``(1, d)``
  for operand 0's / 1's free dim d."""
  (c0, c1), (b0, b1) = dn
  labels = [("b", i) for i in range(len(b0))]
  labels += [(0, d) for d in range(ranks[0]) if d not in c0 and d not in b0]
  labels += [(1, d) for d in range(ranks[1]) if d not in c1 and d not in b1]
  return labels


def _attention(view, exp) -> Match | None:
  soft = _softmax(view, exp)
  if soft is None:
    return None
  logits, axis, probs, inner = soft
  rank = len(View.aval(logits).shape)
  found = _back_to_scores(view, logits)
  if found is None:
    return None
  qk, chain = found
  qk_shape = View.aval(qk.outs[0]).shape
  walk = _Walk([(o,) for o in range(len(qk_shape))], dict(enumerate(qk_shape)))
  for case, site, operand in chain:
    if not case.apply(view, site, walk, operand):
      return None
  logit_labels = walk.labels
  where = {a: d for d, label in enumerate(logit_labels) for a in label}  # scores-product dim -> logits dim
  (c0, c1), (b0, b1) = qk.params["dimension_numbers"]
  x, y = qk.ins
  dot_dims = _dot_labels(qk.params["dimension_numbers"], (len(View.aval(x).shape), len(View.aval(y).shape)))
  if len(logit_labels[axis]) != 1 or dot_dims[logit_labels[axis][0]][0] == "b":
    return None
  key_atom = logit_labels[axis][0]
  ki = dot_dims[key_atom][0]
  q_ref, k_ref = (y, x) if ki == 0 else (x, y)
  qc, kc = (c1, c0) if ki == 0 else (c0, c1)
  qb, kb = (b1, b0) if ki == 0 else (b0, b1)
  k_free = [d for d in range(len(View.aval(k_ref).shape)) if d not in kc and d not in kb]
  q_free = [d for d in range(len(View.aval(q_ref).shape)) if d not in qc and d not in qb]
  if len(k_free) != 1 or not q_free:
    return None
  q_atom = {d: dot_dims.index((1 - ki, d)) for d in q_free}
  batch_atoms = [dot_dims.index(("b", i)) for i in range(len(qb))]
  # forward from the probabilities to . values
  scale, walk.labels, walk.scale = walk.scale, list(logit_labels), 1.0
  reasons_before = len(walk.reasons)
  on = _on_to_values(view, probs, walk)
  if on is None:
    return None
  pv, cast, p_ref = on
  if walk.dropout is None and abs(walk.scale - 1.0) > 1e-9:
    walk.reasons.insert(reasons_before, f"the attention weights are scaled by {walk.scale:g} after the softmax")
  (pc0, pc1), (pb0, pb1) = pv.params["dimension_numbers"]
  pi = 0 if pv.ins[0] == p_ref else 1
  if pv.ins[1 - pi] == p_ref:
    return None
  v_ref = pv.ins[1 - pi]
  pc, vc = (pc0, pc1) if pi == 0 else (pc1, pc0)
  pb, vb = (pb0, pb1) if pi == 0 else (pb1, pb0)
  v_rank, p_rank = len(View.aval(v_ref).shape), len(walk.labels)
  v_free = [d for d in range(v_rank) if d not in vc and d not in vb]
  if any(len(label) != 1 for label in walk.labels) or len(v_free) != 1:
    return None
  atom = [label[0] for label in walk.labels]  # the probabilities' dims as the scores product's
  p_free = [d for d in range(p_rank) if d not in pc and d not in pb]
  if [atom[d] for d in pc] != [key_atom] or sorted(atom[d] for d in pb) != sorted(batch_atoms) \
      or sorted(atom[d] for d in p_free) != sorted(q_atom.values()):
    return None
  sites = tuple(inner) + tuple(s for _, s, _ in chain) + (qk, *cast)
  if not qb:
    return _closed(view, Match("attention", pv, sites, source_line(qk.eqn), "no batch or head dimension",
                               (q_ref, k_ref, v_ref), {}, scale, None))
  # the mask, on the logits' dims; from it the query sequence dim
  preds = []
  for pred, labels, keep in walk.preds:
    if any(label not in logit_labels for label in labels):
      return None  # a mask on dims the logits merge
    preds.append((pred, tuple(logit_labels.index(label) for label in labels), keep))
  whole = {d: logit_labels.index((a,)) for d, a in q_atom.items() if (a,) in logit_labels}
  batch_dim = where[batch_atoms[0]]
  if not whole or logit_labels[batch_dim] != (batch_atoms[0],):
    return None
  scores = frozenset(id(s) for s in (*(s for _, s, _ in chain), qk))
  logits_shape = tuple(View.aval(logits).shape)
  q_seq = _query_dim(view, preds, list(whole), whole, axis, rank, logits_shape, batch_dim, scores)
  mask = masks.classify(view, preds, whole[q_seq], axis, rank, logits_shape, batch_dim=batch_dim, scores=scores)
  # operator order: q [b0, seq, b1.., groups.., d..], k [b0, seq, b1.., d..], v [b0, seq, b1.., dv]
  groups = [d for d in q_free if d != q_seq]
  head_atoms = [*batch_atoms[1:], *(q_atom[g] for g in groups)]
  heads = tuple(dict.fromkeys(where[a] for a in head_atoms))  # the logits dims of the operator's heads
  merged = [a for h in heads for a in logit_labels[h] if walk.sizes[a] != 1]
  batch_of_v = {atom[pb[i]]: vb[i] for i in range(len(pb))}
  layout = {
      "q": (qb[0], q_seq, *qb[1:], *groups, *qc),
      "k": (kb[0], k_free[0], *kb[1:], *kc),
      "v": (batch_of_v[batch_atoms[0]], vc[0], *(batch_of_v[a] for a in batch_atoms[1:]), v_free[0]),
      "groups": (len(qb) - 1, len(groups), len(qc)),
      # the logits: their shape, and each dim's axis of a mask array (``b``, ``h``, ``i``, ``j``)
      "logits": logits_shape, "heads": heads,
      "heads_in_order": merged == [a for a in head_atoms if walk.sizes[a] != 1],
      "roles": {batch_dim: "b", whole[q_seq]: "i", axis: "j", **{h: "h" for h in heads}},
  }
  # the result's dims: each labelled by the operator-order position it comes from
  position = {a: i for i, a in enumerate([batch_atoms[0], q_atom[q_seq], *head_atoms])}
  out_pos = []
  for lab in _dot_labels(pv.params["dimension_numbers"], (p_rank, v_rank) if pi == 0 else (v_rank, p_rank)):
    if lab[0] == "b":
      out_pos.append(position[atom[pb[lab[1]]]])
    elif lab[0] == pi:
      out_pos.append(position[atom[lab[1]]])
    else:
      out_pos.append(len(position))
  layout["out"] = tuple(out_pos)
  match = Match("attention", pv, sites, source_line(qk.eqn), "", (q_ref, k_ref, v_ref), layout, scale, mask)
  match.reason = (walk.reasons[0] if walk.reasons else "") or _attention_reason(view, match)
  return _closed(view, match)


def _batched_dot(site) -> bool:
  return site is not None and site.primitive == "dot_general" and bool(site.params["dimension_numbers"][1][0])


def _unread(view, exp) -> Match | None:
  """Attention the cases do not read: a softmax between two batched products (scores, values) with code
  between them that no case reads, reported with the first such equation as its reason; None where the softmax
  is not between two such products (a router's, a loss's)."""
  soft = _softmax(view, exp)
  if soft is None:
    return None
  logits, _, probs, _ = soft
  unread, ref, qk = [], logits, None
  for _ in range(_LONGEST):
    site = view.producer(ref)
    if site is None or _batched_dot(site):
      qk = site
      break
    step = _step(LOGITS_CASES, view, site, ref)
    if step is None:
      unread.append((site, "between the scores and the softmax"))
      step = (None, next((r for r in site.ins if view.scalar(r) is None), None))
    ref = step[1]
  ref, pv = probs, None
  for _ in range(_LONGEST):
    users = view.consumers(ref)
    if len(users) != 1:
      break
    if _batched_dot(users[0]):
      pv = users[0]
      break
    if _step(WEIGHTS_CASES, view, users[0], ref) is None:
      unread.append((users[0], "between the softmax and the values"))
    ref = users[0].outs[0]
  if qk is None or pv is None:
    return None
  if unread:
    site, where = unread[0]
    calls = [view.calls[site.path[:n]].eqn for n in range(len(site.path) - 1, 0, -1)]
    line = next((source_line(e) for e in (site.eqn, *calls) if source_line(e)), "no source line")
    reason = f"{site.primitive} {where} ({line}): no case reads it"
  else:
    reason = "its products' dims do not line up as queries, keys and values"
  return Match("attention", pv, (qk,), source_line(qk.eqn), reason)


def _cudnn_attention(view, site) -> Match:
  """The attention of one call of JAX's cuDNN attention: its layout (``BTNH`` or ``BNTH``, grouped kv heads in
  one head dim), scale and mask; a reason where the operator does not compute it."""
  q, k, v, bias, _, _, q_offsets, *_ = site.ins
  p = site.params
  bnth = p["layout"] == 1
  order = (0, 2, 1, 3) if bnth else (0, 1, 2, 3)
  qa, ka = View.aval(q), View.aval(k)
  batch, heads, t, s = (qa.shape[order[0]], qa.shape[order[2]], qa.shape[order[1]], ka.shape[order[1]])
  logits = (batch, heads, t, s)
  layout = {"q": order, "k": order, "v": order, "groups": (1, 0, 1), "out": order, "logits": logits, "heads": (1,),
            "roles": {0: "b", 1: "h", 2: "i", 3: "j"}}
  mask_type = getattr(p["mask_type"], "name", str(p["mask_type"]))
  window = p.get("sliding_window_length")
  reason = ""
  if p.get("dropout_rate", 0.0):
    reason = f"dropout (rate {p['dropout_rate']})"
  elif p.get("is_training"):
    reason = "returns cuDNN's log-sum-exp (return_residual)"
  elif "PADDING" in mask_type or math.prod(View.aval(q_offsets).shape):
    reason = "sequence lengths or packed offsets (cuDNN's padding mask): pass segment ids or a mask instead"
  elif mask_type not in ("NO_MASK", "CAUSAL"):
    reason = f"cuDNN's {mask_type} mask"
  positional = masks.MaskInfo("none")
  if window is not None and window > 0:
    positional = masks.MaskInfo("sliding_window", (("window", int(window)),))
  elif mask_type == "CAUSAL":
    positional = masks.MaskInfo("causal")
  mask = positional
  if not reason and p["variadic_args"][0]:
    preds = _bias_mask(view, bias)
    if preds is None:
      reason = "adds a bias to the logits"
    else:
      found = masks.classify(view, preds, 2, 3, 4, logits, batch_dim=0)
      if positional.kind == "none" or found.kind in ("none", positional.kind) and found.params in ((),
                                                                                                   positional.params):
        mask = dataclasses.replace(found if positional.kind == "none" else positional, terms=found.terms)
      else:
        mask = masks.MaskInfo("unknown", note="cuDNN's own mask and a positional mask array together")
  call = view.calls.get(site.path[:-1])  # the custom_vjp_call around it: its traceback reaches the user's code
  where = source_line(call.eqn if call is not None else site.eqn)
  match = Match("attention", site, (), where, reason, (q, k, v), layout, float(p["scale"]), mask)
  match.reason = match.reason or _attention_reason(view, match)
  return match


def _bias_mask(view, bias):
  """``[(pred, dims, True)]`` when cuDNN's bias is a boolean mask made a bias (``select_n(mask, large negative,
  0)``, as JAX's cuDNN attention passes a mask), on the logits dims [b, heads, q, k]; else None."""
  ref, dims = bias, (0, 1, 2, 3)
  for _ in range(16):
    site = view.producer(ref)
    if site is None:
      return None
    if site.primitive == "broadcast_in_dim":
      ref, dims = site.ins[0], tuple(dims[d] for d in site.params["broadcast_dimensions"])
    elif site.primitive == "reshape" and math.prod(View.aval(site.ins[0]).shape) == math.prod(
        View.aval(ref).shape) and [n for n in View.aval(site.ins[0]).shape if n != 1] == [
        n for n in View.aval(ref).shape if n != 1]:
      src = View.aval(site.ins[0]).shape
      kept = [d for d, n in zip(dims, View.aval(ref).shape) if n != 1]
      it = iter(kept)
      dims = tuple(next(it) if n != 1 else None for n in src)
      ref = site.ins[0]
    elif site.primitive in _PASS:
      ref = site.ins[0]
    elif site.primitive == "select_n" and len(site.ins) == 3:
      pred, dropped, kept = site.ins
      fill, zero = view.scalar(dropped), view.scalar(kept)
      if fill is None or zero != 0 or fill > NEGATIVE_FILL or View.aval(pred).dtype != np.bool_:
        return None
      return [(pred, dims, True)]
    else:
      return None
  return None


def _query_dim(view, preds, q_free, q_logit, axis, rank, shape, batch_dim, scores):
  """The query free dim that is the sequence: the one a causal or sliding-window mask runs along, else the one
  segment ids run along, else the longest."""
  if len(q_free) > 1 and preds:
    found = {d: masks.classify(view, preds, q_logit[d], axis, rank, tuple(shape), batch_dim=batch_dim,
                               scores=scores) for d in q_free}
    for test in (lambda m: m.kind in ("causal", "sliding_window", "band"), masks.has_segments):
      for d in q_free:
        if test(found[d]):
          return d
  return max(q_free, key=lambda d: (shape[q_logit[d]], -d))


def _attention_reason(view, m: Match) -> str:
  q, k, v = (View.aval(r) for r in m.operands)
  if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
    return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: the operator takes one floating dtype"
  d = math.prod(q.shape[a] for a in m.layout["q"][len(q.shape) - m.layout["groups"][2]:])
  dv = v.shape[m.layout["v"][-1]]
  if d != dv:
    return f"the values' head size {dv} differs from the queries' {d}"
  if masks.route(m.mask) is None:
    return m.mask.describe()
  if not m.layout.get("heads_in_order", True) and "h" in (masks.mask_axes(m.mask, m.layout["roles"]) or ()):
    return "a per-head mask on logits whose heads are merged in another order than the operator's (kv heads first)"
  return ""


def _closed(view, m: Match) -> Match | None:
  """``m``, or None where a replaced equation's result is used outside it (the weights returned, say)."""
  inside = {id(s) for s in m.inner} | {id(m.anchor)}
  for s in m.inner:
    for r in s.outs:
      if r is None:
        continue
      if view.is_output(r):
        m.reason = m.reason or ("its attention weights are a result of the program (returned, or stored by a "
                                "sow): no operator gives them")
        return m
      if any(id(u) not in inside for u in view.consumers(r)):
        m.reason = m.reason or "its attention weights are used elsewhere: no operator gives them"
        return m
  return m


# ------------------------------------------------------------------ matmul
def _matmul(view, site) -> Match:
  lhs, rhs = site.ins
  (lc, rc), (lb, rb) = site.params["dimension_numbers"]
  la, ra = View.aval(lhs), View.aval(rhs)
  l_free = [d for d in range(len(la.shape)) if d not in lc and d not in lb]
  r_free = [d for d in range(len(ra.shape)) if d not in rc and d not in rb]
  layout = {"lhs": (*l_free, *lc), "rhs": (*rc, *r_free), "free": (len(l_free), len(r_free)), "k": len(lc)}
  m = Match("matmul", site, (), source_line(site.eqn), "", (lhs, rhs), layout)
  m.reason = _matmul_reason(site, la, ra)
  return m


def gemm_sizes(m: Match) -> tuple[int, int, int]:
  """``(m, k, n)`` of a matmul match."""
  la, ra = (View.aval(r) for r in m.operands)
  nl, _ = m.layout["free"]
  lhs = [la.shape[d] for d in m.layout["lhs"]]
  rhs = [ra.shape[d] for d in m.layout["rhs"]]
  return math.prod(lhs[:nl]), math.prod(lhs[nl:]), math.prod(rhs[m.layout["k"]:])


def _matmul_reason(site, la, ra) -> str:
  (lc, _), (lb, _) = site.params["dimension_numbers"]
  if lb:
    return "batch dimensions (not one GEMM)"
  if not lc:
    return "nothing contracted (an outer product)"
  if la.dtype != ra.dtype or not jnp.issubdtype(la.dtype, jnp.floating):
    return f"dtypes {la.dtype}, {ra.dtype}: the operator takes one floating dtype"
  precision = site.params.get("precision")
  pair = precision if isinstance(precision, (tuple, list)) else (precision,)
  if not all(p is None or jax.lax.Precision(p) == jax.lax.Precision.DEFAULT for p in pair):
    return f"precision {precision} above the default"
  pet = site.params.get("preferred_element_type")
  if pet is not None and np.dtype(pet) != la.dtype:
    return f"result type {np.dtype(pet)} wider than the inputs' {la.dtype}"
  return ""
