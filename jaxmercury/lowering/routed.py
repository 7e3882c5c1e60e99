"""A dispatched schedule (``Schedule.dispatch``) lowered: the routed exchange and the grouped expert GEMM.

Per device, inside the schedule's ``shard_map`` (its layouts, padding and
global signature are the plan's, as for any schedule):

1. route the device's stored tokens (``programs.moe.route``); with a
   capacity, count the assignments in global token order: each device's
   per-expert counts are all-gathered over the token levels and the counts of
   the devices holding earlier tokens are added (``programs.moe.kept``);
2. all-gather the tokens over the levels that split the experts' hidden
   width (expert tensor parallelism);
3. per chunk of tokens (the schedule's serial token loops): put each kept
   (token, expert) row into the slot buffer of the device holding the
   expert, all-to-all over the experts' level, compute the received rows
   grouped by local expert (``jax.lax.ragged_dot``, the dense masked form,
   or a grouped GEMM kernel: ``kernels.moe.grouped_gemm``), all-to-all
   the results back and sum them with the gate weights;
4. reduce-scatter (or all-reduce) the partial outputs over the hidden-width
   levels.

Gradients are JAX's through this program (the all-to-all transposes to the
reverse all-to-all, ``ragged_dot`` to its transposed GEMMs, a grouped GEMM
kernel by its own ``custom_vjp``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmercury.analysis import dispatch as dispatches
from jaxmercury.kernels import registry
from jaxmercury.programs.moe import chosen, kept, route, swiglu


def routed_per_device(schedule, plan):
  """``per_device(*stored blocks) -> the output's stored block`` for a dispatched schedule."""
  prog, routing = schedule.program, schedule.program.routing
  d = dispatches.of(schedule, plan)
  num_experts = prog.axes[routing.experts].extent
  tokens = prog.axes[routing.tokens].extent
  top_k, capacity = routing.top_k, routing.capacity
  slots = d.slots(schedule.padded[routing.tokens], schedule.levels, top_k, capacity)
  rest = tuple(lv for lv in d.hidden_levels if lv not in d.gathered)
  dtype = prog.writes.dtype

  def per_device(x, router, w_gate, w_up, w_down):
    n = x.shape[0]
    rank = jax.lax.axis_index(d.token_levels)
    valid = rank * n + jnp.arange(n) < tokens  # padded tokens route nowhere
    experts, gates = route(x, router, top_k)
    before = None
    if capacity is not None:
      counts = jnp.sum(chosen(experts, valid, num_experts), axis=0)
      every = jax.lax.all_gather(counts, d.token_levels)  # [devices holding tokens, experts], in token order
      before = jnp.sum(jnp.where((jnp.arange(every.shape[0]) < rank)[:, None], every, 0), axis=0)
    keep = kept(experts, valid, capacity, num_experts, before)
    weights = jnp.where(keep, gates, 0.0)
    if d.gathered:
      x, experts, weights, keep = (jax.lax.all_gather(a, d.gathered, axis=0, tiled=True)
                                   for a in (x, experts, weights, keep))
    size = x.shape[0] // d.chunks
    ys = []
    for c in range(d.chunks):  # unrolled: one chunk's exchange can overlap another's GEMMs
      part = slice(c * size, (c + 1) * size)
      exchange = _ragged_exchange if d.exchange == "ragged" else _exchange
      ys.append(exchange(x[part], experts[part], weights[part], keep[part], w_gate, w_up, w_down,
                         level=d.level, peers=d.size, local=d.local_experts, slots=slots, gemm=d.gemm))
    y = jnp.concatenate(ys) if len(ys) > 1 else ys[0]
    if d.gathered:
      y = jax.lax.psum_scatter(y, d.gathered, scatter_dimension=0, tiled=True)
    if rest:
      y = jax.lax.psum(y, rest)
    return y.astype(dtype)

  return per_device


def _exchange(x, experts, weights, keep, w_gate, w_up, w_down, *, level, peers, local, slots, gemm):
  """One chunk: the kept rows to their experts' devices and back, summed with their weights (float32 [n, d])."""
  n, k = experts.shape
  flat = experts.reshape(-1)
  keep = keep.reshape(-1)
  dest = jnp.where(keep, flat // local, peers)  # out of bounds: dropped, sent nowhere
  hits = (dest[:, None] == jnp.arange(peers)).astype(jnp.int32)
  slot = jnp.take_along_axis(jnp.cumsum(hits, axis=0) - hits, jnp.minimum(dest, peers - 1)[:, None], axis=1)[:, 0]
  rows = jnp.repeat(x, k, axis=0)
  send = jnp.zeros((peers, slots, x.shape[1]), x.dtype).at[dest, slot].set(rows, mode="drop")
  send_e = jnp.full((peers, slots), local, jnp.int32).at[dest, slot].set(flat % local, mode="drop")
  recv = jax.lax.all_to_all(send, level, 0, 0)
  recv_e = jax.lax.all_to_all(send_e, level, 0, 0)
  out = grouped_ffn(recv.reshape(peers * slots, -1), recv_e.reshape(-1), w_gate, w_up, w_down, gemm=gemm)
  back = jax.lax.all_to_all(out.reshape(peers, slots, -1), level, 0, 0)
  got = back[jnp.minimum(dest, peers - 1), slot]  # [n * k, d]; a dropped row's weight is zero
  return jnp.einsum("nk,nkd->nd", weights, got.reshape(n, k, -1))


def _ragged_exchange(x, experts, weights, keep, w_gate, w_up, w_down, *, level, peers, local, slots, gemm):
  """``_exchange`` with ``ragged_all_to_all``: only the kept rows move, each peer's run packed after the last.

  The rows are sorted by destination; the per-destination counts are all-gathered over the level (``counts[src,
  dst]``), from which every device knows where its run lands in each peer's receive buffer and where the
  results return. The receive buffer holds ``peers * slots`` rows, as the padded exchange's.
  """
  n, k = experts.shape
  flat, keep = experts.reshape(-1), keep.reshape(-1)
  dest = jnp.where(keep, flat // local, peers)  # dropped rows sort last and are sent nowhere
  order = jnp.argsort(dest, stable=True)
  sizes = jnp.sum(dest[:, None] == jnp.arange(peers), axis=0).astype(jnp.int32)
  counts = jax.lax.all_gather(sizes, level)  # [src, dst]
  me = jax.lax.axis_index(level)
  before = (jnp.arange(peers) < me)[:, None]
  starts = jnp.cumsum(sizes) - sizes  # my run for each destination, in my sorted rows
  lands = jnp.sum(jnp.where(before, counts, 0), axis=0).astype(jnp.int32)  # where my run lands at each dst
  received = counts[:, me]
  at = (jnp.cumsum(received) - received).astype(jnp.int32)  # where each source's run sits in my buffer
  rows = jnp.repeat(x, k, axis=0)[order]
  ids = (flat % local).astype(jnp.int32)[order]
  recv = jax.lax.ragged_all_to_all(rows, jnp.zeros((peers * slots, x.shape[1]), x.dtype), starts, sizes, lands,
                                   received, axis_name=level)
  recv_ids = jax.lax.ragged_all_to_all(ids, jnp.full((peers * slots,), local, jnp.int32), starts, sizes, lands,
                                       received, axis_name=level)
  filled = jnp.arange(peers * slots) < jnp.sum(received)
  out = grouped_ffn(recv, jnp.where(filled, recv_ids, local), w_gate, w_up, w_down, gemm=gemm)
  home = jnp.sum(jnp.where(before.T, counts, 0), axis=1).astype(jnp.int32)  # src's run for me, in src's rows
  back = jax.lax.ragged_all_to_all(out, jnp.zeros((n * k, out.shape[1]), out.dtype), at, received, home,
                                   sizes, axis_name=level)
  got = jnp.zeros_like(back).at[order].set(back)  # back to (token, choice) order; dropped rows stay zero
  return jnp.einsum("nk,nkd->nd", weights, got.reshape(n, k, -1))


def grouped_ffn(rows, experts, w_gate, w_up, w_down, *, gemm: str = "ragged_dot"):
  """Each row through its expert's SwiGLU FFN (float32 ``[rows, d]``); rows of expert id ``>= len(w_gate)`` give 0.

  Args:
    rows: [m, d] token rows.
    experts: [m] int32 local expert of each row (``len(w_gate)``: an empty slot).
    w_gate, w_up: [e, d, f]; w_down: [e, f, d].
    gemm: ``"ragged_dot"``: rows sorted by expert, one ``jax.lax.ragged_dot`` per projection; ``"dense"``:
      every expert on every row, masked; a registered grouped GEMM kernel (``"mosaic_grouped_gemm"``): the
      rows sorted the same way, each projection through the kernel where it computes its shapes and dtype
      (``GroupedKernel.problem``), else through ``ragged_dot``.
  """
  local = w_gate.shape[0]
  if gemm == "dense":
    a = jnp.einsum("md,edf->emf", rows, w_gate, preferred_element_type=jnp.float32)
    b = jnp.einsum("md,edf->emf", rows, w_up, preferred_element_type=jnp.float32)
    out = jnp.einsum("emf,efd->emd", swiglu(a, b, rows.dtype), w_down, preferred_element_type=jnp.float32)
    mask = (experts[None, :] == jnp.arange(local)[:, None]).astype(jnp.float32)
    return jnp.einsum("em,emd->md", mask, out)
  order = jnp.argsort(experts, stable=True)
  sizes = jnp.sum(experts[:, None] == jnp.arange(local), axis=0).astype(jnp.int32)
  xs = rows[order]
  dot = grouped_dot(gemm)
  a = dot(xs, w_gate, sizes)
  b = dot(xs, w_up, sizes)
  out = dot(swiglu(a, b, rows.dtype), w_down, sizes)
  out = jnp.where((experts[order] < local)[:, None], out, 0.0)
  return jnp.zeros_like(out).at[order].set(out)


def grouped_dot(gemm: str):
  """``dot(x [m, k], w [e, k, n], sizes [e]) -> float32 [m, n]``, grouped: ``jax.lax.ragged_dot``, or the
  grouped GEMM kernel ``gemm`` where it computes the shapes and dtype (``ragged_dot`` where not)."""
  ragged = lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
  if gemm in dispatches.BUILTIN_GEMMS:
    return ragged
  kernel = registry.grouped(gemm)
  config = kernel.configure()

  def dot(x, w, sizes):
    if kernel.problem(x.shape[1], w.shape[2], x.dtype, config) is not None or w.dtype != x.dtype:
      return ragged(x, w, sizes)
    return kernel.gemm(x, w, sizes, config=config, out_dtype=jnp.float32)

  return dot
