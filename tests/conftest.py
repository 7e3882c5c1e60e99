"""Test set-up: a simulated 8-device CPU platform, meshes and input helpers."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

MESH_SHAPES = {"8": ((8,), ("x",)), "2x4": ((2, 4), ("node", "gpu")), "4x2": ((4, 2), ("node", "gpu"))}


def make_mesh(name: str, axis_type=AxisType.Auto):
  shape, names = MESH_SHAPES[name]
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


@pytest.fixture(params=sorted(MESH_SHAPES))
def mesh(request):
  return make_mesh(request.param)


_seed = np.random.SeedSequence()


def fresh_key():
  """A new PRNG key for every call: inputs are fresh each run, never fixed."""
  return jax.random.key(int(_seed.spawn(1)[0].generate_state(1)[0]))


def tolerance(dtype):
  return {np.dtype(jnp.float32): 2e-5, np.dtype(jnp.bfloat16): 2e-2}[np.dtype(dtype)]


def rel_err(y, ref):
  y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def assert_matches(schedule, inputs=None, reference=None):
  """Runs ``schedule`` and compares with the program's reference in float64 terms."""
  prog = schedule.program
  xs = inputs if inputs is not None else prog.random_inputs(fresh_key())
  ref = reference if reference is not None else prog.reference(*xs)
  y = schedule.compile()(*xs)
  assert y.shape == ref.shape and y.dtype == ref.dtype
  assert np.all(np.isfinite(np.asarray(y, np.float32)))
  err = rel_err(y, ref)
  assert err < tolerance(prog.writes.dtype), f"rel err {err:.2e}\n{schedule}"
