"""The fused ring-attention lowering: a ``ring`` schedule, causal or not, run as one Mosaic GPU kernel per device.

Where a schedule stores the queries, keys, values and output with their
sequence axes split over one mesh level L holding every device, and nothing
else split (the ``ring`` and ``ring_zigzag`` strategies do; the check reads
the plan's layouts), device ``r``'s output block is the attention of its
queries over every device's keys: ``pallas_kernels.fused_ring_attention``
computes it in one launch, K and V travelling the ring inside the kernel.

Causal programs too: the sequence is taken in natural order or with both
sequence axes in the same zigzag order (``Schedule.zigzag``, as
``ring_zigzag`` stores them: ``2 n`` chunks over the ``n`` devices of L, or
any even multiple of ``n``), and the kernel masks by the global positions
that order gives each device. Registered in ``jaxmercury.shard_map.fused`` as
``fused_ring_attention`` (kind ``"ring_attention"``); gradients come from the
dual programs of ``backward_schedule`` (cuDNN blocks on GPUs), fed by the
kernel's own output and log-sum-exp. ``fused_ring_attention_ws`` runs the same schedules with
the warp-specialized kernel (``pallas_kernels.fused_ring_attention_ws``: two
consumer warpgroups and a memory warpgroup per CTA).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmercury.errors import PreconditionError
from jaxmercury.schedules import dual
from jaxmercury.shard_map import fused

RING_ATTENTION = "ring_attention"
# The fastest configuration measured on 2 x H200 (benchmarks/results/2026-11-23-fused_attention-2cta-2xH200.json):
# blocks small enough for two CTAs per SM, so that one CTA's softmax overlaps the other's wgmma.
DEFAULTS = {"block_q": 64, "block_kv": 64, "max_concurrent_steps": 2, "ctas_per_sm": 2}


@dataclasses.dataclass(frozen=True)
class AttentionPlacement:
  """Where a schedule puts attention's buffers: the sequence split over mesh level ``level``.

  Attributes:
    level, size: the mesh level L and its size.
    q, k, v, o: the program's buffers in the attention pattern's roles.
    axes: program axis of each pattern role (``b``, ``i``, ``j``, ``hk``, ``g``, ``d``).
    causal: whether the program masks keys after the query.
    order, chunks: how the sequence is stored, the kernel's ``order``
      (``"natural"`` or ``"zigzag"``) and zigzag chunks (None for natural).
  """

  level: str
  size: int
  q: object
  k: object
  v: object
  o: object
  axes: dict
  kind: str = RING_ATTENTION
  causal: bool = False
  order: str = "natural"
  chunks: int | None = None

  def local_shape(self, schedule) -> tuple[int, ...]:
    """``(b, s_local, kv heads, group, d)`` of one device's blocks."""
    ext = lambda role: schedule.program.axes[self.axes[role]].extent
    return ext("b"), ext("i") // self.size, ext("hk"), ext("g"), ext("d")

  def dtype_problem(self) -> str | None:
    dtypes = [np.dtype(x.dtype) for x in (self.q, self.k, self.v, self.o)]
    if dtypes[0] not in fused.HALF or any(d != dtypes[0] for d in dtypes):
      return (f"buffers q, k, v, o are {', '.join(map(str, dtypes))}: the fused ring-attention kernel takes "
              "bf16 or fp16, one dtype")
    return None

  def memory_bytes(self, schedule) -> int:
    """q, k, v and o blocks, the ``n - 1`` received K and V blocks, and the float32 log-sum-exp."""
    b, s, hk, g, d = self.local_shape(schedule)
    item = np.dtype(self.q.dtype).itemsize
    return (2 * b * s * hk * g * d + 2 * self.size * b * s * hk * d) * item + 4 * b * hk * g * s


def placement(schedule) -> AttentionPlacement | str:
  """The schedule's ``AttentionPlacement``, or why the fused ring-attention kernel does not apply."""
  from jaxmercury.pallas_kernels import patterns
  prog = schedule.program
  try:
    match = patterns.match("attention", prog)
  except PreconditionError as e:
    return f"the fused ring-attention kernel computes attention (loop-nest pattern 'attention'): {e}"
  if match.params.get("emit_lse"):
    return "the fused ring-attention lowering writes the output only; this program also writes the log-sum-exp"
  if reason := fused.whole_nest_problem(schedule, zigzag=True):  # zigzag sequence axes: checked below
    return reason
  axes = {role: ax for ax, role in match.to_pattern.items()}
  (q, k, v), o = prog.reads, prog.writes
  extent = lambda role: prog.axes[axes[role]].extent
  padded = [ax for ax in (axes["i"], axes["j"], axes["d"]) if schedule.padded.get(ax, prog.axes[ax].extent)
            != prog.axes[ax].extent]
  if padded:
    return f"axis {padded[0]!r} is padded; the fused kernel takes no padding (padded keys would be attended)"
  if extent("i") != extent("j"):
    return f"queries ({extent('i')}) and keys ({extent('j')}) differ in length; the fused kernel takes self-attention"
  if extent("d") % 64 or extent("d") > 192:  # 64 query rows x (64 keys + d) float32 values in one warpgroup
    return f"head dimension {axes['d']!r} = {extent('d')} must be a multiple of 64 and at most 192"
  q_layout = schedule.plan().storage[q.name]
  need = (f"the fused ring attention needs {q.name}[{axes['i']}@L], {k.name}[{axes['j']}@L], {v.name}[{axes['j']}@L], "
          f"{o.name}[{axes['i']}@L], nothing else split")
  level, n_split = fused.splitting_level(schedule, q_layout[q.axes.index(axes["i"])])
  if level is None:
    return (f"buffer {q.name} is stored {fused.layout_text(q, q_layout)}: its sequence is split over {n_split} "
            f"levels; {need}")
  split_axes = [(q, axes["i"]), (k, axes["j"]), (v, axes["j"]), (o, axes["i"])]
  if reason := fused.split_problem(schedule, level, split_axes, need):
    return reason
  size = schedule.levels[level]
  s_local = extent("i") // size
  if s_local % max(DEFAULTS["block_q"], DEFAULTS["block_kv"]):
    return (f"each device holds {s_local} positions of {axes['i']!r}, not a multiple of the kernel's blocks "
            f"({DEFAULTS['block_q']}, {DEFAULTS['block_kv']})")
  chunks = _zigzag_chunks(schedule, axes, level, size)
  if isinstance(chunks, str):
    return chunks
  return AttentionPlacement(level, size, q, k, v, o, axes, causal=bool(match.params.get("causal")),
                            order="natural" if chunks is None else "zigzag", chunks=chunks)


def _zigzag_chunks(schedule, axes, level: str, size: int) -> int | None | str:
  """The zigzag chunks of the sequence axes (None: natural order), or why the kernel cannot take their order."""
  zigzags, i, j = schedule.zigzags, axes["i"], axes["j"]
  if not zigzags:
    return None
  kernel = "the fused ring-attention kernel"
  other = [a for a in zigzags if a not in (i, j)]
  if other:
    return (f"axis {other[0]!r} is stored in zigzag order; {kernel} takes zigzag order on the sequence axes "
            f"{i!r} and {j!r} only")
  if zigzags.get(i) != zigzags.get(j):
    said = lambda a: f"in zigzag order in {zigzags[a]} chunks" if a in zigzags else "in natural order"
    return (f"axis {i!r} is stored {said(i)} but axis {j!r} {said(j)}; {kernel} takes queries and keys in one "
            "order")
  chunks = zigzags[i]
  if chunks % size:
    return (f"axis {i!r} is stored in zigzag order in {chunks} chunks, not a multiple of the {size} devices of "
            f"level {level!r}; {kernel} takes whole chunks per device")
  chunk = schedule.program.axes[i].extent // chunks
  if chunk % max(DEFAULTS["block_q"], DEFAULTS["block_kv"]):
    return (f"axis {i!r} is stored in zigzag chunks of {chunk} positions, not a multiple of the kernel's blocks "
            f"({DEFAULTS['block_q']}, {DEFAULTS['block_kv']}): a tile must lie in one chunk")
  return chunks


def _blocks(params):
  from jaxmercury.pallas_kernels.fused_ring_attention import Blocks
  return Blocks(params["block_q"], params["block_kv"], params["max_concurrent_steps"])


def _params(params, itemsize) -> str | None:
  for key, v in params.items():
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      return f"{key}={v!r} must be a positive int"
  return None


def _fit(p: AttentionPlacement, params, schedule) -> str | None:
  """Whether the blocks fit this schedule: shared memory at its head dimension, its local sequence and chunks."""
  from jaxmercury.pallas_kernels.mosaic_matmul import SMEM_BYTES
  d = p.local_shape(schedule)[4]
  itemsize = np.dtype(p.q.dtype).itemsize
  blocks, per_sm = _blocks(params), params["ctas_per_sm"]
  if reason := blocks.problem(d, itemsize):
    return reason
  smem = blocks.smem_bytes(d, itemsize)
  if per_sm * smem > SMEM_BYTES:  # every CTA must be resident: the ring waits on them
    return (f"ctas_per_sm={per_sm}: {per_sm} CTAs of {smem} bytes of shared memory (head dim {d}) exceed one SM's "
            f"{SMEM_BYTES}")
  return _rows_problem(p, schedule, {"block_q": params["block_q"], "block_kv": params["block_kv"]})


def _rows_problem(p: AttentionPlacement, schedule, rows: dict) -> str | None:
  """The first of ``rows`` (name -> rows of a tile) that does not divide each device's positions (each zigzag
  chunk's, in zigzag order): a tile lies in one contiguous run of positions."""
  run = p.local_shape(schedule)[1] if p.chunks is None else schedule.program.axes[p.axes["i"]].extent // p.chunks
  where = "each device's positions" if p.chunks is None else "each zigzag chunk's positions"
  for name, n in rows.items():
    if run % n:
      return f"{name}={n} does not divide {where} of {p.axes['i']!r} ({run})"
  return None


def _tile(params):
  return params["block_q"], params["block_kv"], 64


def _per_device(kernel, p: AttentionPlacement, num_ctas, **blocks):
  """``kernel`` (a fused ring attention) on the stored blocks, ``q [b, s, hk, g, d]`` and ``k, v [b, s, hk, d]``,
  in the placement's mask and order; ``num_ctas()`` is asked when traced.

  ``per_device(q, k, v)`` returns the output block; ``per_device(q, k, v, with_lse=True)`` the block of the
  backward's residuals, ``[b, s, hk, g, d + 1]`` float32: the output, then the log-sum-exp (the
  ``attention_with_lse`` program's ``olse``).
  """
  def per_device(q, k, v, *, with_lse: bool = False):
    b, s, hk, g, d = q.shape
    out, lse = kernel(q.reshape(b, s, hk * g, d), k, v, p.level, causal=p.causal, order=p.order,
                      chunks=p.chunks, num_ctas=num_ctas(), **blocks)
    out = out.reshape(b, s, hk, g, d)
    if not with_lse:
      return out
    lse = jnp.transpose(lse, (0, 2, 1)).reshape(b, s, hk, g, 1)  # [b, h, s] -> [b, s, hk, g, 1]
    return jnp.concatenate([out.astype(jnp.float32), lse.astype(jnp.float32)], axis=-1)
  return per_device


def _make(p: AttentionPlacement, params, interpret: bool):
  from jaxmercury.pallas_kernels.fused_ring_attention import fused_ring_attention
  from jaxmercury.pallas_kernels.peer_gemm import sm_count
  blocks = _blocks(params)
  return _per_device(fused_ring_attention, p,
                     lambda: fused.INTERPRET_CTAS if interpret else params["ctas_per_sm"] * sm_count(),
                     block_q=blocks.block_q, block_kv=blocks.block_kv,
                     max_concurrent_steps=blocks.max_concurrent_steps, interpret=interpret)


# ------------------------------------------------------------------ the warp-specialized kernel
WS_DEFAULTS = {"block_q": 64, "block_kv": 128, "max_concurrent_steps": 2}


def _ws_blocks(params):
  from jaxmercury.pallas_kernels.fused_ring_attention_ws import WsBlocks
  return WsBlocks(params["block_q"], params["block_kv"], params["max_concurrent_steps"])


def _ws_fit(p: AttentionPlacement, params, schedule) -> str | None:
  """The blocks at the program's head dimension; a work item's two query tiles and the key tiles in each device's
  positions (each zigzag chunk's)."""
  d = p.local_shape(schedule)[4]
  if reason := _ws_blocks(params).problem(d, np.dtype(p.q.dtype).itemsize):
    return reason
  return _rows_problem(p, schedule, {"2 x block_q": 2 * params["block_q"], "block_kv": params["block_kv"]})


def _ws_make(p: AttentionPlacement, params, interpret: bool):
  from jaxmercury.pallas_kernels.fused_ring_attention_ws import fused_ring_attention_ws
  return _per_device(fused_ring_attention_ws, p, lambda: fused.INTERPRET_CTAS if interpret else None,
                     interpret=interpret, **params)


# ------------------------------------------------------------------ the backward
def backward_schedule(schedule):
  """The loop-nest schedule whose dual programs differentiate a fused ring attention.

  That is ``fused.ordinary_schedule`` (the same layouts and ring, without the
  lowering) with its blocks on cuDNN where the mesh's devices run it
  (``schedules.dual.backward_schedule``): the dq and dk-dv programs run cuDNN's
  flash backward blocks; elsewhere (CPU, interpret mode) XLA's body.
  """
  return dual.backward_schedule(fused.ordinary_schedule(schedule))


def _attach_backward(schedule, per_device):
  """The fused forward with the dual backward of ``backward_schedule``, fed by the kernel's own residuals.

  The forward under differentiation runs the kernel once, keeping its output
  and log-sum-exp (``per_device(..., with_lse=True)`` lowered on the dual's
  ``attention_with_lse`` schedule, which stores them as the output); the
  backward recomputes probabilities block by block from them. Nothing runs
  twice and no score matrix is kept.
  """
  from jaxmercury.shard_map.differentiate import differentiable
  from jaxmercury.shard_map.lower import lower
  forward = lower(schedule, jit=False, per_device=per_device)

  def keeping_residuals(with_lse):
    return jax.jit(lower(with_lse, jit=False, per_device=functools.partial(per_device, with_lse=True)))

  return differentiable(fused.ordinary_schedule(schedule), forward, forward_with_lse=keeping_residuals)


fused.PLACEMENTS[RING_ATTENTION] = placement
fused.KIND_NAMES[RING_ATTENTION] = "ring attention"
fused.BACKWARDS[RING_ATTENTION] = fused.OwnBackward(backward_schedule, _attach_backward,
                                                   "the dual programs, from the kernel's output and log-sum-exp")
fused.register(fused.FusedLowering(
    "fused_ring_attention",
    "our Mosaic GPU kernel (pallas_kernels.fused_ring_attention): K and V tiles forwarded by TMA into the left "
    "neighbour as they are consumed, online softmax across the ring steps, causal tiles masked or skipped by "
    "global position; ctas_per_sm CTAs share each SM",
    DEFAULTS, "fused_ring_attention", fused.interpretable_devices, _params, _tile, _make, interpret=True,
    kind=RING_ATTENTION, fit_problem=_fit))
fused.register(fused.FusedLowering(
    "fused_ring_attention_ws",
    "our warp-specialized Mosaic GPU kernel (pallas_kernels.fused_ring_attention_ws): two consumer warpgroups "
    "take turns on the tensor cores while a memory warpgroup loads K and V tiles and forwards them to the left "
    "neighbour; one CTA per SM",
    WS_DEFAULTS, "fused_ring_attention_ws", fused.interpretable_devices, _params,
    lambda params: (2 * params["block_q"], params["block_kv"], 64), _ws_make, interpret=True, kind=RING_ATTENTION,
    fit_problem=_ws_fit))
