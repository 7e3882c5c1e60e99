"""Checks shared by the GPU kernel tests: a patched attention schedule against the float32 reference."""

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import AxisType

import jaxmercury as jm

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


def check_schedule(schedule, tol=TOL):
  """The compiled attention ``schedule`` on fresh inputs matches the float32 reference."""
  prog = schedule.program
  xs = prog.random_inputs(fresh_key())
  ref = _float32(schedule).reference(*[x.astype(jnp.float32) for x in xs])
  err = rel_err(schedule.compile()(*xs).astype(jnp.float32), ref)
  assert err < tol, f"rel err {err}\n{schedule}"


def check_gradients(schedule, tol=GRAD_TOL):
  """The compiled ``schedule``'s output, and its dq, dk, dv, match the float32 reference's (``jax.vjp``)."""
  prog = schedule.program
  xs = prog.random_inputs(fresh_key())
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  ref_out, ref_vjp = jax.vjp(_float32(schedule).reference, *[x.astype(jnp.float32) for x in xs])
  f = schedule.compile()
  out, vjp = jax.vjp(lambda *a: f(*a).astype(jnp.float32), *xs)
  err = rel_err(out, ref_out)
  assert err < TOL, f"output: rel err {err}\n{schedule}"
  for name, g, w in zip("qkv", vjp(cot), ref_vjp(cot)):
    err = rel_err(g.astype(jnp.float32), w)
    assert err < tol, f"d{name}: rel err {err}\n{schedule}"
