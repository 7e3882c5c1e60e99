"""Attention's dq and dk-dv programs run in one nest: one backward block call per block pair.

The dual schedules (``schedules.dual``) are two programs, since dq reduces
over keys and dk, dv over queries. Run apart, each recomputes every block
pair's probabilities, and a kernel whose backward returns dq, dk and dv
together (cuDNN's) runs twice per pair. Built with
``attention_duals(joint=True)`` the two schedules walk the same loops
(``nest.joint_problem``), and ``lower_joint`` runs them in one nest: per
block pair one call of a joint block, whose dq part the dq program
accumulates (in a ring: on the device, as keys and values pass by) and whose
dk-dv part the dk-dv program accumulates (in a ring: travelling with the keys
and values back to their owner).

Before / after, a ring over ``x`` (``rank`` visits key block ``(t + rank + 1) % n``)::

  dq program:  for j0 in n (shift):          joint:  for j0 in n (shift):
                 dq += ds k                             (dq_blk, dkv_blk) <- one backward block call
  dkv program: for j0 in n (shift, travel):              dq += dq_blk
                 dkv <- pass(dkv) + [ds^T q, p^T do]     dkv <- pass(dkv) + dkv_blk
"""

from __future__ import annotations

from collections.abc import Callable

from jaxmercury.kernels import registry
from jaxmercury.lowering.lower import lower_joint
from jaxmercury.lowering.nest import joint_problem


def joint_reason(dq, dkv) -> str | None:
  """Why the dq and dk-dv schedules cannot run in one nest (None: they can)."""
  kq, kkv = dq.kernel or "xla", dkv.kernel or "xla"
  backward = registry.backward_of(kq)
  if backward is None or backward.joint is None or (backward.dkv.name if backward.dkv else "xla") != kkv:
    return f"kernels {kq!r} and {kkv!r} have no joint block"
  return joint_problem(dq, [dkv])


def joint_backward(dq, dkv, *, jit: bool = True) -> Callable | None:
  """``f(q, k, v, o, do, lse) -> (dq, dkv)`` running both schedules in one nest, or None where they cannot be.

  Args:
    dq, dkv: the dual schedules of ``attention_duals(..., joint=True)``.
    jit: wrap the result in ``jax.jit``.
  """
  if joint_reason(dq, dkv) is not None:
    return None
  registry.lookup(dq.kernel or "xla", dq.program, dq.mesh)  # raises where the devices cannot run it
  mode = registry.local(dq.kernel or "xla").interprets(dq.mesh)
  return lower_joint([dq, dkv], registry.backward_of(dq.kernel or "xla").joint(dq.program, **mode), jit=jit)
