"""Fusing adjacent collectives, after Chimera's Table 3.

A resharding starts as the redundant sequence ``collectives.naive`` builds
(synchronize the producer's output, then take the consumer's part). Rules
replace a pair of collectives on one mesh level by something cheaper; steps
on other levels that touch other dimensions commute and may sit between the
pair. Each rule states its preconditions, checked on the layout the first
collective of the pair receives:

=======================================  ===============================  ===========  =========================
pair (same level)                        fused                            Chimera      bytes (N = level size)
=======================================  ===============================  ===========  =========================
all_reduce, slice(d)                     reduce_scatter(d)                TP+SP        2(N-1)/N -> (N-1)/N
all_gather(d), slice(d)                  nothing                          A-G + R-S    (N-1) -> 0
all_gather(d), slice(e), e != d          all_to_all(d -> e)               A-G + A2A    (N-1) -> (N-1)/N
all_to_all(a -> b), all_to_all(b -> c)   all_to_all(a -> c); nothing      A2A + A2A    2(N-1)/N -> (N-1)/N or 0
                                         if c == a
all_gather(d), reduce_scatter(d)         scale by N (local)               A-G + R-S    2(N-1) -> 0
=======================================  ===============================  ===========  =========================

(bytes in units of the local block before the pair.) Every rewrite is exact:
the fused sequence leaves the same values in the same layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jaxmercury.analysis import collectives as cl
from jaxmercury.analysis.collectives import Collective
from jaxmercury.analysis.layouts import Layout


@dataclasses.dataclass(frozen=True)
class Rule:
  """A rewrite of two collectives on one mesh level.

  Attributes:
    name: the rule's name.
    first: the kind of the first collective.
    second: the kind of the second.
    preconditions: what must hold, in words (checked by ``applies``).
    applies: ``applies(a, b, layout)`` with ``layout`` the one ``a`` receives.
    fuse: ``fuse(a, b, sizes)`` -> the replacement steps.
    chimera: the row of Chimera's Table 3 it follows.
  """

  name: str
  first: str
  second: str
  preconditions: str
  applies: Callable[[Collective, Collective, Layout], bool]
  fuse: Callable[[Collective, Collective], list[Collective]]
  chimera: str


def _same_level(a, b):
  return a.level == b.level


RULES: tuple[Rule, ...] = (
    Rule("allreduce_slice_is_reducescatter", cl.ALL_REDUCE, cl.SLICE,
         "same level; the tensor is partial over it; the slice keeps each rank's own chunk "
         "(chunk r on rank r) along a dimension the level does not split yet",
         lambda a, b, lay: _same_level(a, b) and a.level in lay.partial and a.level not in lay.levels,
         lambda a, b: [Collective(cl.REDUCE_SCATTER, a.level, b.dim)],
         "A-R split into R-S + A-G, then A-G + R-S = nothing (TP+SP)"),
    Rule("allgather_slice_cancels", cl.ALL_GATHER, cl.SLICE,
         "same level and dimension; the level is the minor split of the dimension (so the slice "
         "takes back exactly the chunk the rank held)",
         lambda a, b, lay: _same_level(a, b) and a.dim == b.dim and lay.dims[a.dim][-1:] == (a.level,),
         lambda a, b: [],
         "A-G + R-S = nothing"),
    Rule("allgather_slice_is_alltoall", cl.ALL_GATHER, cl.SLICE,
         "same level, different dimensions; the level is the minor split of the gathered dimension "
         "and becomes the minor split of the sliced one",
         lambda a, b, lay: _same_level(a, b) and a.dim != b.dim and lay.dims[a.dim][-1:] == (a.level,),
         lambda a, b: [Collective(cl.ALL_TO_ALL, a.level, a.dim, b.dim)],
         "A-G + A2A = A2A"),
    Rule("alltoall_alltoall_compose", cl.ALL_TO_ALL, cl.ALL_TO_ALL,
         "same level; the second moves the level out of the dimension the first moved it into",
         lambda a, b, lay: _same_level(a, b) and b.dim == a.to_dim,
         lambda a, b: [] if b.to_dim == a.dim else [Collective(cl.ALL_TO_ALL, a.level, a.dim, b.to_dim)],
         "A2A + A2A = A2A"),
    Rule("allgather_reducescatter_is_scale", cl.ALL_GATHER, cl.REDUCE_SCATTER,
         "same level and dimension; the tensor is not partial over the level; the level is the minor "
         "split of the dimension (the reduce-scatter then sums N equal copies of each rank's own chunk)",
         lambda a, b, lay: (_same_level(a, b) and a.dim == b.dim and a.level not in lay.partial
                            and lay.dims[a.dim][-1:] == (a.level,)),
         lambda a, b: [Collective(cl.SCALE, a.level)],
         "A-G + R-S = nothing (up to the factor N the reduction adds)"),
)


def commutes(a: Collective, b: Collective) -> bool:
  """Whether ``a`` then ``b`` equals ``b`` then ``a``: different levels and no dimension in common."""
  return a.level != b.level and not (a.touches() & b.touches())


def fuse_once(layout: Layout, seq: Sequence[Collective], rules: Sequence[Rule] = RULES):
  """Applies the first rule that matches a pair in ``seq``.

  The second collective of a pair may sit later in the sequence if it
  commutes with every step between; it is moved next to the first.

  Returns:
    ``(new sequence, rule)``, or ``(seq, None)`` when nothing applies.
  """
  seq = list(seq)
  lays = cl.trajectory(layout, seq)
  for i, a in enumerate(seq):
    for j in range(i + 1, len(seq)):
      b = seq[j]
      if all(commutes(c, b) for c in seq[i + 1:j]):
        for rule in rules:
          if a.kind == rule.first and b.kind == rule.second and rule.applies(a, b, lays[i]):
            return seq[:i] + rule.fuse(a, b) + seq[i + 1:j] + seq[j + 1:], rule
  return seq, None


def fuse(layout: Layout, seq: Sequence[Collective], rules: Sequence[Rule] = RULES):
  """Applies rules until none matches.

  Returns:
    ``(fused sequence, names of the rules applied in order)``. The fused
    sequence ends in the same layout as ``seq``.
  """
  seq, applied = list(seq), []
  end = cl.trajectory(layout, seq)[-1]
  while True:
    seq, rule = fuse_once(layout, seq, rules)
    if rule is None:
      break
    applied.append(rule.name)
  assert cl.trajectory(layout, seq)[-1] == end, (seq, end)
  return seq, applied
