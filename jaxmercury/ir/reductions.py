"""Associative combines for reduction loops.

A reduction's state is what a partial computation over a slice of the
reduction loops returns. States combine pairwise (``combine``), across a mesh
level (``all_reduce``, ``reduce_scatter``), and end as the output
(``finalize``). States are kept in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


class Reduction:
  """Base class: how partial results of reduction loops merge."""

  name = "reduction"

  def state_axes(self, out_axes: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """The axes of each state leaf, given the output's canonical axes."""
    return (tuple(out_axes),)

  def from_body(self, result):
    """Turns a body's return value into a state (a tuple of leaves)."""
    return (jnp.asarray(result, jnp.float32),)

  def combine(self, a, b):
    raise NotImplementedError

  def all_reduce(self, state, level: str):
    raise NotImplementedError

  def reduce_scatter(self, state, level: str, dims: Sequence[int]):
    raise NotImplementedError

  def finalize(self, state, dtype):
    return state[0].astype(dtype)


class Sum(Reduction):
  """Plain summation: GEMM, weighted sums."""

  name = "sum"

  def combine(self, a, b):
    return tuple(x + y for x, y in zip(a, b))

  def all_reduce(self, state, level):
    return tuple(jax.lax.psum(x, level) for x in state)

  def reduce_scatter(self, state, level, dims):
    return tuple(jax.lax.psum_scatter(x, level, scatter_dimension=d, tiled=True)
                 for x, d in zip(state, dims))


class LogSumExp(Reduction):
  """The online-softmax merge of attention partials.

  The state is ``(out, lse)``: ``out`` normalized over the keys seen so far and
  ``lse`` their log-sum-exp, with the value axes (``value_axes``, which must
  be the output's trailing axes) dropped. A row that has seen no unmasked key
  has ``lse = -inf`` and ``out = 0``. With ``emit_lse`` the output's last
  axis is one longer than the value axis and carries the log-sum-exp (the
  residual a backward pass needs).
  """

  name = "logsumexp"

  def __init__(self, value_axes: Sequence[str], emit_lse: bool = False):
    self.value_axes = tuple(value_axes)
    self.emit_lse = emit_lse

  def state_axes(self, out_axes):
    return tuple(out_axes), tuple(a for a in out_axes if a not in self.value_axes)

  def _expand(self, w):
    return w.reshape(w.shape + (1,) * len(self.value_axes))

  def from_body(self, result):
    out, lse = result
    return jnp.asarray(out, jnp.float32), jnp.asarray(lse, jnp.float32)

  @staticmethod
  def _weights(lses):
    top = lses[0]
    for x in lses[1:]:
      top = jnp.maximum(top, x)
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    return safe, [jnp.exp(x - safe) for x in lses]

  def combine(self, a, b):
    (oa, la), (ob, lb) = a, b
    top, (wa, wb) = self._weights([la, lb])
    total = wa + wb
    out = (oa * self._expand(wa) + ob * self._expand(wb)) / self._expand(jnp.where(total == 0, 1, total))
    return out, top + jnp.log(total)

  def all_reduce(self, state, level):
    out, lse = state
    top = jax.lax.pmax(jax.lax.stop_gradient(lse), level)  # a shift: results do not depend on it
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - safe)
    num = jax.lax.psum(out * self._expand(w), level)
    total = jax.lax.psum(w, level)
    return num / self._expand(jnp.where(total == 0, 1, total)), safe + jnp.log(total)

  def reduce_scatter(self, state, level, dims):
    out, lse = state
    out_dim, lse_dim = dims
    top = jax.lax.pmax(jax.lax.stop_gradient(lse), level)  # a shift: results do not depend on it
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - safe)
    num = jax.lax.psum_scatter(out * self._expand(w), level, scatter_dimension=out_dim, tiled=True)
    total = jax.lax.psum_scatter(w, level, scatter_dimension=lse_dim, tiled=True)
    n = jax.lax.psum(1, level)
    safe = _local_slice(safe, level, lse_dim, n)
    return num / self._expand(jnp.where(total == 0, 1, total)), safe + jnp.log(total)

  def finalize(self, state, dtype):
    if self.emit_lse:  # the output holds the value axis and, after it, the log-sum-exp
      return jnp.concatenate([state[0], state[1][..., None]], axis=-1).astype(dtype)
    return state[0].astype(dtype)


def _local_slice(x, level, dim, n):
  size = x.shape[dim] // n
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(level) * size, size, dim)
