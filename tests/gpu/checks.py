"""Checks shared by the GPU kernel tests: a patched attention schedule against the float32 reference, a fused
all-gather GEMM against all_gather + dot."""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.kernels.gemm.allgather import reference as allgather_reference

TOL = 2e-2  # bf16 relative norm error of outputs
GRAD_TOL = 3e-2  # and of gradients


def gpu_mesh():
  """One level over every local device."""
  return jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(AxisType.Auto,))


def library_with(program, strategy: str, kernel: str, mesh=None):
  """The library's ``strategy`` for ``program`` on ``mesh`` (default every GPU), patched with ``kernel``.

  Skips the calling test when the strategy does not apply.
  """
  lib = jm.library(program, mesh or gpu_mesh())
  if strategy not in lib:
    pytest.skip(f"{strategy} does not apply")
  return lib[strategy].patch(kernel)


def _float32(schedule):
  prog = schedule.program
  return jm.programs.attention(**{**prog.params, "dtype": jnp.float32})


def _upcast(xs):
  """Floating inputs in float32; integers (segment ids) as they are."""
  return [x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs]


def check_schedule(schedule, tol=TOL):
  """The compiled attention ``schedule`` on fresh inputs matches the float32 reference."""
  prog = schedule.program
  xs = prog.random_inputs(fresh_key())
  ref = _float32(schedule).reference(*_upcast(xs))
  err = rel_err(schedule.compile()(*xs).astype(jnp.float32), ref)
  assert err < tol, f"rel err {err}\n{schedule}"


def check_gradients(schedule, tol=GRAD_TOL):
  """The compiled ``schedule``'s output, and its dq, dk, dv, match the float32 reference's (``jax.vjp``)."""
  prog = schedule.program
  xs = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  ref_out, ref_vjp = jax.vjp(_float32(schedule).reference, *_upcast(xs))
  f = schedule.compile()
  out, vjp = jax.vjp(lambda *a: f(*a).astype(jnp.float32), *xs)
  err = rel_err(out, ref_out)
  assert err < TOL, f"output: rel err {err}\n{schedule}"
  for name, g, w in zip("qkv", vjp(cot), ref_vjp(cot)):
    err = rel_err(g.astype(jnp.float32), w)
    assert err < tol, f"d{name}: rel err {err}\n{schedule}"


def check_allgather_matmul(mesh, m_shard, k, n, kernel, label):
  """``kernel(a, b)`` (a fused all-gather GEMM over ``"x"``, per device) on fresh inputs, rows of A and columns
  of B split over ``mesh``, against the float32 product and the unfused program; then once more (the semaphores
  and receive buffers of one call must not leak into the next). ``label`` names the variant in failures."""
  devices = mesh.devices.size
  a = jax.device_put(jax.random.normal(fresh_key(), (devices * m_shard, k), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P("x", None)))
  b = jax.device_put(jax.random.normal(fresh_key(), (k, devices * n), jnp.float32).astype(jnp.bfloat16),
                     NamedSharding(mesh, P(None, "x")))

  def run(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"),
                                 check_vma=False))(a, b)

  got = run(kernel)
  want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
  assert got.shape == want.shape
  assert rel_err(got.astype(jnp.float32), want) < 2e-2, label
  unfused = run(lambda a, b: allgather_reference(a, b, "x"))
  assert rel_err(got.astype(jnp.float32), unfused.astype(jnp.float32)) < 2e-2, label
  again = run(kernel)
  assert rel_err(again.astype(jnp.float32), want) < 2e-2, label
