"""Attention and GEMMs found in a traced program.

``find(view, devices)`` returns one ``Match`` for each attention and each
contraction of the program:

- attention: ``dot_general`` (queries . keys) -> optional scale, masks
  (``select_n`` with a large negative fill), casts and transposes ->
  softmax (``exp(x - max x) / sum``) -> ``dot_general`` (. values), in any
  dimension order, with grouped key-value heads (a query operand with more
  free dimensions than the sequence: ``jax.nn.dot_product_attention``'s
  reshape of the query heads) or without. What ``jnp.einsum`` attention,
  ``flax.nnx.dot_product_attention`` and ``jax.nn.dot_product_attention``'s
  XLA implementation trace to.
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
      m = _attention(view, site)
      if m is not None and not (taken & {id(s) for s in (m.anchor, *m.inner)}):
        found.append(m)
        taken |= {id(s) for s in (m.anchor, *m.inner)}
  for site in view.sites:
    if site.primitive == "dot_general" and id(site) not in taken:
      found.append(_matmul(view, site))
  order = {id(s): i for i, s in enumerate(view.sites)}
  return sorted(found, key=lambda m: order[id(m.anchor)])


# ------------------------------------------------------------------ attention
def _producer(view, ref, name):
  site = view.producer(ref)
  return site if site is not None and site.primitive == name else None


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
  # back from the logits to queries . keys
  ref, dims, scale, preds, chain, reason = logits, tuple(range(rank)), 1.0, [], [], ""
  while True:
    site = view.producer(ref)
    if site is None:
      return None
    p = site.primitive
    if p == "dot_general":
      break
    chain.append(site)
    if p in _PASS:
      ref = site.ins[0]
    elif p in ("mul", "div"):
      a, b = site.ins
      if p == "mul" and view.scalar(a) is not None:
        scale, ref = scale * view.scalar(a), b
      elif view.scalar(b) is not None:
        scale, ref = (scale * view.scalar(b) if p == "mul" else scale / view.scalar(b)), a
      else:
        return None
    elif p == "transpose":
      perm = site.params["permutation"]
      inv = [0] * len(perm)
      for i, src in enumerate(perm):
        inv[src] = dims[i]
      ref, dims = site.ins[0], tuple(inv)
    elif p == "select_n" and len(site.ins) == 3:
      pred, case0, case1 = site.ins
      f0, f1 = view.scalar(case0), view.scalar(case1)
      if f0 is not None and f0 <= NEGATIVE_FILL:
        preds.append((pred, dims, True))
        ref = case1
      elif f1 is not None and f1 <= NEGATIVE_FILL:
        preds.append((pred, dims, False))
        ref = case0
      else:
        return None
    elif p == "add":
      reason = reason or "adds a bias to the logits"
      ref = site.ins[0] if view.producer(site.ins[0]) is not None else site.ins[1]
    elif p == "tanh":
      reason = reason or "caps the logits (tanh)"
      ref = site.ins[0]
    else:
      return None
  qk = view.producer(ref)
  (c0, c1), (b0, b1) = qk.params["dimension_numbers"]
  x, y = qk.ins
  labels = _dot_labels(qk.params["dimension_numbers"], (len(View.aval(x).shape), len(View.aval(y).shape)))
  at = {d: i for i, d in enumerate(dims)}  # logits dim -> dot output dim
  key_label = labels[at[axis]]
  if key_label[0] == "b":
    return None
  ki = key_label[0]
  q_ref, k_ref = (y, x) if ki == 0 else (x, y)
  qc, kc = (c1, c0) if ki == 0 else (c0, c1)
  qb, kb = (b1, b0) if ki == 0 else (b0, b1)
  k_free = [d for d in range(len(View.aval(k_ref).shape)) if d not in kc and d not in kb]
  q_free = [d for d in range(len(View.aval(q_ref).shape)) if d not in qc and d not in qb]
  if len(k_free) != 1 or not q_free:
    return None
  # logits dims of each query free dim and batch pair
  q_logit = {d: dims[labels.index((1 - ki, d))] for d in q_free}
  batch_logit = [dims[labels.index(("b", i))] for i in range(len(qb))]
  # forward from the probabilities to . values
  ref, cast = probs, []
  while True:
    users = view.consumers(ref)
    if len(users) == 1 and users[0].primitive in _PASS:
      cast.append(users[0])
      ref = users[0].outs[0]
      continue
    dots = [u for u in users if u.primitive == "dot_general"]
    if len(dots) != 1:
      return None
    pv = dots[0]
    break
  (pc0, pc1), (pb0, pb1) = pv.params["dimension_numbers"]
  pi = 0 if pv.ins[0] == ref else 1
  if pv.ins[1 - pi] == ref:
    return None
  v_ref = pv.ins[1 - pi]
  pc, vc = (pc0, pc1) if pi == 0 else (pc1, pc0)
  pb, vb = (pb0, pb1) if pi == 0 else (pb1, pb0)
  v_rank = len(View.aval(v_ref).shape)
  v_free = [d for d in range(v_rank) if d not in vc and d not in vb]
  if tuple(pc) != (axis,) or sorted(pb) != sorted(batch_logit) or len(v_free) != 1:
    return None
  p_free = [d for d in range(rank) if d not in pc and d not in pb]
  if sorted(p_free) != sorted(q_logit.values()):
    return None
  if not qb:
    return _closed(view, Match("attention", pv, tuple(inner) + tuple(chain) + (qk, *cast), source_line(qk.eqn),
                               "no batch or head dimension", (q_ref, k_ref, v_ref), {}, scale, None))
  # the mask, and from it the query sequence dim
  scores = frozenset(id(s) for s in (*chain, qk))
  logits_shape = tuple(View.aval(logits).shape)
  q_seq = _query_dim(view, preds, q_free, q_logit, axis, rank, logits_shape, batch_logit[0], scores)
  mask = masks.classify(view, preds, q_logit[q_seq], axis, rank, logits_shape, batch_dim=batch_logit[0],
                        scores=scores)
  # operator order: q [b0, seq, b1.., groups.., d..], k [b0, seq, b1.., d..], v [b0, seq, b1.., dv]
  groups = [d for d in q_free if d != q_seq]
  heads = (*batch_logit[1:], *(q_logit[g] for g in groups))  # the logits dims of the operator's heads, in order
  batch_of_v = {pb[i]: vb[i] for i in range(len(pb))}
  v_batch = [batch_of_v[batch_logit[i]] for i in range(len(qb))]
  layout = {
      "q": (qb[0], q_seq, *qb[1:], *groups, *qc),
      "k": (kb[0], k_free[0], *kb[1:], *kc),
      "v": (v_batch[0], vc[0], *v_batch[1:], v_free[0]),
      "groups": (len(qb) - 1, len(groups), len(qc)),
      # the logits: their shape, and each dim's axis of a mask array (``b``, ``h``, ``i``, ``j``)
      "logits": logits_shape, "heads": heads,
      "roles": {batch_logit[0]: "b", q_logit[q_seq]: "i", axis: "j", **{h: "h" for h in heads}},
  }
  # the result's dims: each labelled by the operator-order position it comes from
  out_labels = _dot_labels(pv.params["dimension_numbers"], (rank, v_rank) if pi == 0 else (v_rank, rank))
  std = {("l", batch_logit[0]): 0, ("l", q_logit[q_seq]): 1}
  pos = 2
  for i in range(1, len(qb)):
    std[("l", batch_logit[i])] = pos
    pos += 1
  for g in groups:
    std[("l", q_logit[g])] = pos
    pos += 1
  std[("v", v_free[0])] = pos
  out_pos = []
  for lab in out_labels:
    if lab[0] == "b":
      out_pos.append(std[("l", pb[lab[1]])])
    elif lab[0] == pi:
      out_pos.append(std[("l", lab[1])])
    else:
      out_pos.append(std[("v", lab[1])])
  layout["out"] = tuple(out_pos)
  match = Match("attention", pv, tuple(inner) + tuple(chain) + (qk, *cast), source_line(qk.eqn), "",
                (q_ref, k_ref, v_ref), layout, scale, mask)
  match.reason = reason or _attention_reason(view, match)
  return _closed(view, match)


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
  return ""


def _closed(view, m: Match) -> Match | None:
  """``m``, or None where a replaced equation's result is used outside it (the weights returned, say)."""
  inside = {id(s) for s in m.inner} | {id(m.anchor)}
  for s in m.inner:
    for r in s.outs:
      if r is None:
        continue
      if view.is_output(r) or any(id(u) not in inside for u in view.consumers(r)):
        m.reason = m.reason or "its attention weights are used elsewhere"
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
