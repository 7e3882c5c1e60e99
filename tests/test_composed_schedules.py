"""Schedules composed from the primitives (the tuner's design space) equal the reference."""

import random

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_matches, fresh_key, make_mesh

import jaxmercury as jm
from jaxmercury.tuner import enumerate_schedules

# (the program, how many of its design-space schedules each mesh samples)
PROGRAMS = {
    "mha_causal": (lambda: jm.programs.attention(2, 4, 4, 32, 32, 8, causal=True), 9),
    "gqa": (lambda: jm.programs.attention(1, 8, 2, 16, 32, 8), 6),
    "mqa_causal": (lambda: jm.programs.attention(1, 4, 1, 32, 16, 8, causal=True), 5),
    "matmul": (lambda: jm.programs.matmul(32, 16, 24), 7),
    "matmul_ragged": (lambda: jm.programs.matmul(24, 16, 40), 4),
    "weighted_sum": (lambda: jm.programs.weighted_sum(16, 24), 4),
}


def _check_all(prog, schedules):
  """Each schedule against the reference, on one draw of fresh inputs for all of them."""
  xs = prog.random_inputs(fresh_key())
  ref = jax.jit(prog.reference)(*xs)
  for schedule in schedules:
    assert_matches(schedule, xs, ref)


def _sample(prog, mesh, count):
  library = {s.to_json() for s in jm.library(prog, mesh).values()}
  space = [s for s in enumerate_schedules(prog, mesh) if s.to_json() not in library]
  # A fixed sample so failures reproduce; the inputs are fresh every run.
  return random.Random(f"{prog.name}{prog.params}{mesh.shape}").sample(space, min(count, len(space)))


@pytest.mark.parametrize("mesh_name", ["8", "2x4", "4x2"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_composed_schedules_match_reference(mesh_name, program):
  build, count = PROGRAMS[program]
  prog = build()
  schedules = _sample(prog, make_mesh(mesh_name), count)
  assert len(schedules) == count
  _check_all(prog, schedules)


def test_more_than_thirty_composed_schedules_per_mesh():
  """A hundred in all over the three meshes (each schedule compiled and run: the suite's time)."""
  assert sum(count for _, count in PROGRAMS.values()) >= 30


def test_composed_schedules_bf16():
  prog = jm.programs.attention(1, 4, 2, 32, 32, 16, causal=True, dtype=jnp.bfloat16)
  _check_all(prog, _sample(prog, make_mesh("2x4"), 6))


def test_hand_written_compositions():
  """Compositions the enumeration does not reach: reorder, join, replicate, in/out layouts."""
  from jax.sharding import PartitionSpec as P
  mesh = make_mesh("2x4")
  prog = jm.programs.attention(2, 8, 4, 32, 48, 8, causal=True)
  a = jm.Schedule(prog, mesh)
  a.tile("i", 4).parallelize("i0", "gpu").tile("j", 4).shift("j0", "i0").tile("j1", 3)
  a.reorder("j10", "b").tile("b", 2).parallelize("b0", "node")
  b = jm.Schedule(prog, mesh).tile("j", 4).tile("j1", 2).join("j10", "j11").parallelize("j0", "gpu")
  b.tile("i", 2).parallelize("i0", "node").replicate("q", "i0")
  c = jm.Schedule(prog, mesh, in_shardings=(P(None, "gpu"), P(None, None, "node"), P()),
                  out_sharding=P("node", None, "gpu"))
  c.tile("hk", 4).parallelize("hk0", "gpu").tile("i", 2).parallelize("i0", "node")
  c.tile("j", 2).shift("j0", "i0").replicate("o", "i0")
  _check_all(prog, [a, b, c])
  m = jm.Schedule(jm.programs.matmul(32, 24, 40), mesh)
  m.tile("k", 4).parallelize("k0", "gpu").tile("m", 4).shift("m0", "k0").tile("n", 2).parallelize("n0", "node")
  m.shard("A", "n0", axis="m").replicate("C", "n0")
  assert_matches(m)
