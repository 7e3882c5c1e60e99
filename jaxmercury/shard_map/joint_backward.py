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

import functools
from typing import Callable

from jaxmercury.pallas_kernels import registry
from jaxmercury.programs.attention_backward import dq_dkv_block
from jaxmercury.shard_map.lower import lower_joint
from jaxmercury.shard_map.nest import joint_problem


def _xla_block(dq_program):
  return functools.partial(dq_dkv_block, causal=dq_program.params["causal"])


def _cudnn_block(dq_program):
  from jaxmercury.pallas_kernels.cudnn_attention import cudnn_backward_block
  causal = dq_program.params["causal"]
  return functools.partial(cudnn_backward_block, causal=causal, part="dq_dkv",
                           fallback=functools.partial(dq_dkv_block, causal=causal))


# The dq program's kernel -> (the dk-dv program's kernel it pairs with, the joint block's maker).
JOINT_BLOCKS: dict[str, tuple[str, Callable]] = {"xla": ("xla", _xla_block),
                                                "cudnn_attention_dq": ("cudnn_attention_dkv", _cudnn_block)}


def _kernel(schedule) -> str:
  return (schedule.kernel or "xla").partition("[")[0]


def joint_reason(dq, dkv) -> str | None:
  """Why the dq and dk-dv schedules cannot run in one nest (None: they can)."""
  kq, kkv = _kernel(dq), _kernel(dkv)
  if kq not in JOINT_BLOCKS or JOINT_BLOCKS[kq][0] != kkv:
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
  return lower_joint([dq, dkv], JOINT_BLOCKS[_kernel(dq)][1](dq.program), jit=jit)
