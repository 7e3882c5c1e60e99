"""Test set-up: a simulated 8-device CPU platform, meshes and input helpers."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

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


# ------------------------------------------------------------------ lowering for GPUs that are not here
H100 = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")


def h100_mesh(devices: int):
  """An abstract one-level mesh ``("x",)`` of ``devices`` H100s (132 SMs each), for lowering without GPUs."""
  return jax.sharding.AbstractMesh((devices,), ("x",), axis_types=(AxisType.Auto,), abstract_device=H100)


def lower_for_gpus(fn, *specs, mesh) -> str:
  """``jit(fn)`` traced on ``specs`` under the abstract ``mesh`` and lowered for CUDA: the module's text.

  The lowering runs Mosaic GPU's own passes (layouts, barriers, shared
  memory: a kernel over 227 KiB fails here); it is no CUDA compile and no run.
  """
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def mosaic_kernels(text: str) -> int:
  """How many Mosaic GPU kernels a lowered module launches."""
  return text.count("custom_call @mosaic_gpu")


# ------------------------------------------------------------------ cuDNN stood in by XLA on CPU
def _cudnn_standin(q, k, v, causal):
  b, i, hk, g, d = q.shape
  out, lse = jax.nn.dot_product_attention(q.reshape(b, i, hk * g, d), k, v, is_causal=causal,
                                          implementation="xla", return_residual=True)
  return out.reshape(q.shape).astype(jnp.float32), lse.reshape(b, i, hk, g).astype(jnp.float32)


def _cudnn_backward_standin(q, k, v, o, do, lse, causal):
  """cuDNN's backward math (merged o and lse given) for one aligned block pair, in XLA."""
  import jaxmercury as jm
  from jaxmercury.programs import attention_backward as ab
  sizes = {"i": q.shape[1], "j": k.shape[1]}
  ctx = jm.BlockContext(starts={}, sizes=sizes, extents=sizes)
  dq = ab.dq_block(ctx, q, k, v, o, do, lse, causal=causal)
  dkv = ab.dkv_block(ctx, q, k, v, o, do, lse, causal=causal)
  return dq, dkv[..., 0, :], dkv[..., 1, :]


@pytest.fixture
def cpu_cudnn(monkeypatch):
  """The cuDNN attention kernels offered on CPU (any dtype), cuDNN's calls stood in by XLA.

  Returns the list of the backward calls that ran (one ``"backward"`` each,
  recorded while running, so branches traced but not taken do not count).
  """
  import dataclasses

  from jaxmercury.kernels import cudnn_attention, registry
  ran = []

  def backward(*args):
    jax.debug.callback(lambda: ran.append("backward"))
    return _cudnn_backward_standin(*args)
  monkeypatch.setattr(cudnn_attention, "_cudnn", _cudnn_standin)
  monkeypatch.setattr(cudnn_attention, "_cudnn_backward_masked", backward)
  for name in ("cudnn_attention", "cudnn_attention_dq", "cudnn_attention_dkv"):
    kernel = registry._KERNELS[name]
    monkeypatch.setitem(registry._KERNELS, name, dataclasses.replace(kernel, platforms=frozenset({"cpu"}), dtypes=None))
  return ran
