"""Loops and branches of a traced program, rebuilt around rewritten bodies.

``scan``, ``while`` and ``cond`` equations hold their bodies as closed
jaxprs. ``bodies(eqn)`` gives them; ``rebuild(eqn, vals, run)`` computes the
equation on ``vals`` again with ``jax.lax.scan`` / ``while_loop`` / ``switch``,
each body computed by ``run[i](body_args)`` (the rewriter's evaluation of
that body, with its own attention and GEMMs replaced). The loop's own
parameters (length, direction, unrolling) are kept; gradients flow through
the rebuilt ``scan`` (and ``cond``) as through the original.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

PRIMITIVES = frozenset({"scan", "while", "cond"})


def bodies(eqn) -> list:
  """The closed jaxprs of a loop or branch equation's bodies (scan: its body; while: its condition, then its
  body; cond: its branches); empty for any other equation."""
  name, p = eqn.primitive.name, eqn.params
  if name == "scan":
    return [p["jaxpr"]]
  if name == "while":
    return [p["cond_jaxpr"], p["body_jaxpr"]]
  if name == "cond":
    return list(p["branches"])
  return []


def invariants(eqn) -> list[dict[int, int]]:
  """For each body (``bodies`` order), ``{body input index: equation operand index}`` of the inputs that are
  the same at every iteration (a scan's and a while loop's constants, a branch's operands)."""
  name, p = eqn.primitive.name, eqn.params
  if name == "scan":
    nc = p["num_consts"] if "num_consts" in p else len(list(p["ft_in"].unpack()[0]))
    return [{i: i for i in range(nc)}]
  if name == "while":
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    return [{i: i for i in range(nc)}, {i: nc + i for i in range(nb)}]
  if name == "cond":
    return [{i: i + 1 for i in range(len(eqn.invars) - 1)} for _ in p["branches"]]
  return []


def rebuild(eqn, vals: Sequence, run: Sequence[Callable]) -> list:
  """``eqn``'s results on ``vals``, each body ``i`` computed by ``run[i]`` (a list of values to a list)."""
  name, p = eqn.primitive.name, eqn.params
  if name == "scan":
    if "num_consts" in p:
      nc, ncarry = p["num_consts"], p["num_carry"]
      consts, init, xs = list(vals[:nc]), list(vals[nc:nc + ncarry]), list(vals[nc + ncarry:])
    else:  # newer JAX: a tree (``ft_in``) groups the operands as consts, carries and inputs
      consts, init, xs = (list(t) for t in p["ft_in"].update(list(vals)).unpack())
      ncarry = len(init)

    def step(carry, x):
      outs = run[0]([*consts, *carry, *x])
      return outs[:ncarry], outs[ncarry:]

    carry, ys = jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]
  if name == "while":
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = list(vals[:nc]), list(vals[nc:nc + nb]), list(vals[nc + nb:])
    out = jax.lax.while_loop(lambda c: run[0]([*cconsts, *c])[0], lambda c: run[1]([*bconsts, *c]), init)
    return list(out)
  if name == "cond":
    index, *ops = vals
    return list(jax.lax.switch(index, [(lambda *o, f=f: f(list(o))) for f in run], *ops))
  raise ValueError(f"rebuild: {name} is not a loop or branch")
