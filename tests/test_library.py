"""Every library strategy equals the reference on every test mesh."""

import jax
import jax.numpy as jnp
import pytest
from conftest import MESH_SHAPES, assert_matches, fresh_key, make_mesh

import jaxmercury as jm

ATTENTION = {
    "mha": dict(batch=2, heads=8, kv_heads=8, q_len=64, kv_len=64, head_dim=16),
    "gqa": dict(batch=1, heads=8, kv_heads=2, q_len=32, kv_len=48, head_dim=8),
    "mqa": dict(batch=1, heads=8, kv_heads=1, q_len=40, kv_len=32, head_dim=8),
    "ragged": dict(batch=1, heads=4, kv_heads=2, q_len=36, kv_len=44, head_dim=8),
}
EXPECTED_ATTENTION = {"context_parallel", "ring", "tree"}


# Pairwise, not the full product: every config on every mesh, each mesh and each config with and without the mask.
PAIRWISE = [(mesh, config, (i + j) % 2 == 1) for i, config in enumerate(sorted(ATTENTION))
            for j, mesh in enumerate(sorted(MESH_SHAPES))]


def _check_all(prog, schedules):
  """Each schedule against the reference, on one draw of fresh inputs for all of them."""
  xs = prog.random_inputs(fresh_key())
  ref = jax.jit(prog.reference)(*xs)
  for schedule in schedules:
    assert_matches(schedule, xs, ref)


@pytest.mark.parametrize("mesh_name,config,causal", PAIRWISE)
def test_attention_library(mesh_name, config, causal):
  mesh = make_mesh(mesh_name)
  prog = jm.programs.attention(**ATTENTION[config], causal=causal)
  lib = jm.library(prog, mesh)
  assert set(lib) >= EXPECTED_ATTENTION
  if config == "mha":
    assert "ulysses" in lib and "head_parallel" in lib
  if len(mesh.axis_names) == 2 and config in ("mha", "mqa"):
    assert "usp" in lib
  _check_all(prog, lib.values())


@pytest.mark.parametrize("shape", [(64, 32, 48), (36, 20, 44), (8, 8, 8)], ids=["multiple", "ragged", "one-each"])
def test_matmul_library(mesh, shape):
  prog = jm.programs.matmul(*shape)
  lib = jm.library(prog, mesh)
  assert set(lib) == {"allgather_matmul", "matmul_reducescatter", "async_tp", "async_tp_reducescatter",
                      "data_parallel"}
  _check_all(prog, lib.values())


@pytest.mark.parametrize("name", ["ring", "ulysses", "context_parallel", "tree"])
def test_attention_library_bf16(name):
  from conftest import make_mesh
  prog = jm.programs.attention(1, 8, 8, 64, 64, 32, causal=True, dtype=jnp.bfloat16)
  assert_matches(jm.library(prog, make_mesh("8"))[name])


@pytest.mark.parametrize("name", ["allgather_matmul", "matmul_reducescatter", "async_tp", "async_tp_reducescatter",
                                  "data_parallel"])
def test_matmul_library_bf16(name):
  from conftest import make_mesh
  prog = jm.programs.matmul(64, 48, 96, dtype=jnp.bfloat16)
  assert_matches(jm.library(prog, make_mesh("2x4"))[name])


def test_weighted_sum_library(mesh):
  prog = jm.programs.weighted_sum(24, 40)
  lib = jm.library(prog, mesh)
  assert {"parallel_i", "parallel_j", "ring_j_over_i"} <= set(lib)
  _check_all(prog, lib.values())


def test_library_on_explicit_mesh():
  """Meshes with Explicit axis types: inputs arrive sharded, every strategy still matches."""
  import jax
  from conftest import fresh_key, make_mesh, rel_err
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = make_mesh("2x4", AxisType.Explicit)
  prog = jm.programs.attention(1, 8, 8, 32, 32, 8, causal=True)
  xs = [jax.device_put(x, NamedSharding(mesh, P(None, "gpu"))) for x in prog.random_inputs(fresh_key())]
  want = jax.jit(prog.reference)(*[jax.device_get(x) for x in xs])
  for name, schedule in jm.library(prog, mesh).items():
    assert rel_err(schedule.compile()(*xs), want) < 2e-5, name
  with jax.set_mesh(mesh):
    f = jm.library(prog, mesh)["ring_zigzag"].compile()
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)))(*xs)
  want_grads = jax.jit(jax.grad(lambda *a: jnp.sum(prog.reference(*a)), argnums=(0, 1, 2)))(
      *[jax.device_get(x) for x in xs])
  for g, w in zip(grads, want_grads):
    assert rel_err(g, w) < 2e-5


def test_zigzag_ring_sends_each_key_block_once():
  """Both query halves meet a travelling K/V block, so the ring has one permute per step and buffer."""
  prog = jm.programs.attention(1, 4, 2, 64, 64, 8, causal=True)
  mesh = make_mesh("8")
  text = jax.jit(jm.library(prog, mesh)["ring_zigzag"].compile()).lower(*prog.random_inputs(fresh_key())).as_text()
  reorders = 4 * 2  # q, k, v and the output, two rounds each between true and zigzag order (test_storage_order)
  assert text.count("collective_permute") == 2 * (8 - 1) + reorders
