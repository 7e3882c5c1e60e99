"""Hand-written ``jax.shard_map`` baselines, independent of jaxmercury.

Each builder takes a one-level mesh whose level is named ``"x"`` and returns
a jitted function of global arrays. The functions are written from the
strategies' descriptions (all-gather then compute, compute then
reduce-scatter, context parallel attention with all-gathered keys and
values), using only ``jax.lax`` collectives and XLA / cuDNN kernels.

Besides the baselines, this module holds the "floor" functions (one device's
share of the work, with no communication) and the "comm alone" functions
(the collectives a strategy issues, with no compute) that a benchmark uses
to judge how much of the communication a schedule hides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "x"


def _mapped(mesh, body, in_specs, out_specs):
  """``jax.jit`` of ``jax.shard_map`` over ``mesh`` with VMA checks off."""
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=False))


def _dot(a, b):
  """A bf16-in, f32-accumulate, input-dtype-out matrix product."""
  return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


# ---------------------------------------------------------------- GEMM


def allgather_matmul(mesh):
  """All-gather matmul: ``x`` row-sharded, ``w`` column-sharded.

  Each rank gathers the whole ``x`` [M, K] and multiplies it by its own
  columns of ``w`` [K, N/n].

  Args:
    mesh: a one-level mesh with level ``"x"``.

  Returns:
    ``f(x [M, K] P("x", None), w [K, N] P(None, "x")) -> [M, N] P(None, "x")``.
  """
  def body(x, w):
    return _dot(jax.lax.all_gather(x, AXIS, axis=0, tiled=True), w)

  return _mapped(mesh, body, (P(AXIS, None), P(None, AXIS)), P(None, AXIS))


def matmul_reducescatter(mesh):
  """Matmul then reduce-scatter: the reduction dimension ``K`` is sharded.

  Each rank computes a full-size partial product from its slice of ``K``;
  the partial products are summed and scattered along rows.

  Args:
    mesh: a one-level mesh with level ``"x"``.

  Returns:
    ``f(x [M, K] P(None, "x"), w [K, N] P("x", None)) -> [M, N] P("x", None)``.
  """
  def body(x, w):
    partial = jnp.dot(x, w, preferred_element_type=jnp.float32)
    total = jax.lax.psum_scatter(partial, AXIS, scatter_dimension=0, tiled=True)
    return total.astype(x.dtype)

  return _mapped(mesh, body, (P(None, AXIS), P(AXIS, None)), P(AXIS, None))


def local_gemm(mesh):
  """The all-gather matmul's floor: each rank's GEMM with no communication.

  ``x`` is stored replicated, so every rank multiplies the whole [M, K] by
  its [K, N/n] columns without moving any data.

  Args:
    mesh: a one-level mesh with level ``"x"``.

  Returns:
    ``f(x [M, K] P(), w [K, N] P(None, "x")) -> [M, N] P(None, "x")``.
  """
  return _mapped(mesh, _dot, (P(), P(None, AXIS)), P(None, AXIS))


def local_gemm_reducescatter(mesh):
  """The reduce-scatter matmul's floor: each rank's partial GEMM, no sum.

  Args:
    mesh: a one-level mesh with level ``"x"``.

  Returns:
    ``f(x [M, K] P(None, "x"), w [K, N] P("x", None))`` giving each rank's
    unreduced [M, N] product, stacked along rows ([n*M, N] P("x", None)).
  """
  return _mapped(mesh, _dot, (P(None, AXIS), P(AXIS, None)), P(AXIS, None))


# ----------------------------------------------------------- attention


def _causal_mask(q_local_len, kv_len):
  """Boolean [1, 1, T, S] mask for this rank's query block (top-left aligned).

  The rank's queries start at ``axis_index * q_local_len`` in the global
  sequence, so the mask must be built from that offset rather than from
  ``is_causal`` (which assumes the block starts at position 0).
  """
  start = jax.lax.axis_index(AXIS) * q_local_len
  q_pos = start + jnp.arange(q_local_len)
  k_pos = jnp.arange(kv_len)
  return (q_pos[:, None] >= k_pos[None, :])[None, None]


def _attend(q, k, v, causal, implementation):
  """``jax.nn.dot_product_attention`` of a local query block on full keys."""
  mask = _causal_mask(q.shape[1], k.shape[1]) if causal else None
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def context_parallel_attention(mesh, causal: bool = False, implementation: str | None = None):
  """Context-parallel attention: all-gather K and V, attend locally.

  Inputs are sequence-sharded. Each rank gathers the whole key and value
  sequences and attends its own queries to them.

  Args:
    mesh: a one-level mesh with level ``"x"``.
    causal: mask keys after each query (using the rank's global query offset).
    implementation: passed to ``jax.nn.dot_product_attention`` (``"cudnn"``,
      ``"xla"`` or ``None``).

  Returns:
    ``f(q [B, S, H, D], k [B, S, KV, D], v [B, S, KV, D]) -> o [B, S, H, D]``,
    all ``P(None, "x")``.
  """
  seq = P(None, AXIS)

  def body(q, k, v):
    k = jax.lax.all_gather(k, AXIS, axis=1, tiled=True)
    v = jax.lax.all_gather(v, AXIS, axis=1, tiled=True)
    return _attend(q, k, v, causal, implementation)

  return _mapped(mesh, body, (seq, seq, seq), seq)


def local_attention(mesh, causal: bool = False, implementation: str | None = None):
  """Attention's floor: each rank's queries against all keys, no communication.

  Keys and values are stored replicated, so nothing moves between devices.

  Args:
    mesh: a one-level mesh with level ``"x"``.
    causal: as in ``context_parallel_attention``.
    implementation: as in ``context_parallel_attention``.

  Returns:
    ``f(q P(None, "x"), k P(), v P()) -> o P(None, "x")``.
  """
  seq = P(None, AXIS)
  return _mapped(mesh, lambda q, k, v: _attend(q, k, v, causal, implementation),
                 (seq, P(), P()), seq)


# ------------------------------------------------------- communication alone


def allgather_comm(mesh, *, axis: int, num_inputs: int = 1):
  """All-gathers of ``num_inputs`` arrays sharded along ``axis``; no compute.

  Args:
    mesh: a one-level mesh with level ``"x"``.
    axis: the sharded dimension.
    num_inputs: how many arrays to gather (2 for attention's K and V).

  Returns:
    ``f(*arrays)`` returning the gathered arrays as a tuple, replicated.
  """
  spec = P(*([None] * axis + [AXIS]))

  def body(*xs):
    return tuple(jax.lax.all_gather(x, AXIS, axis=axis, tiled=True) for x in xs)

  return _mapped(mesh, body, (spec,) * num_inputs, (P(),) * num_inputs)


def ring_comm(mesh, *, axis: int, num_inputs: int = 1):
  """The ring's traffic alone: ``n - 1`` dependent ``ppermute`` steps.

  Each step passes every rank's current blocks to its neighbour, as a ring
  schedule does between compute steps; step ``t + 1`` sends what step ``t``
  received, so the steps cannot overlap one another.

  Args:
    mesh: a one-level mesh with level ``"x"``.
    axis: the sharded dimension of the inputs.
    num_inputs: how many arrays travel (2 for attention's K and V).

  Returns:
    ``f(*arrays)`` returning the blocks held after the last step.
  """
  n = mesh.shape[AXIS]
  spec = P(*([None] * axis + [AXIS]))
  perm = [(r, (r + 1) % n) for r in range(n)]

  def body(*xs):
    for _ in range(n - 1):
      xs = tuple(jax.lax.ppermute(x, AXIS, perm) for x in xs)
    return xs

  return _mapped(mesh, body, (spec,) * num_inputs, (spec,) * num_inputs)
