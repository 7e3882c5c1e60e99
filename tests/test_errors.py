"""Invalid schedules raise a ScheduleError that names the problem, before tracing."""

import pytest
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

import jaxmercury as jm


@pytest.fixture
def mm():
  return jm.Schedule(jm.programs.matmul(64, 32, 48), make_mesh("2x4"))


def test_parallelize_length_must_match_level(mm):
  with pytest.raises(jm.PreconditionError, match=r"parallelize\('m', 'gpu'\): loop extent 64 must equal the size 4.*tile\('m', 4\)"):
    mm.parallelize("m", "gpu")


def test_shift_onto_non_parallel_loop(mm):
  mm.tile("m", 4).tile("n", 4)
  with pytest.raises(jm.PreconditionError, match=r"shift\('m0', 'n0'\): 'n0' is not a parallel loop"):
    mm.shift("m0", "n0")


def test_mesh_level_used_twice(mm):
  mm.tile("m", 4).parallelize("m0", "gpu").tile("n", 4)
  with pytest.raises(jm.PreconditionError, match="mesh level 'gpu' is already used by loop 'm0'"):
    mm.parallelize("n0", "gpu")


def test_unknown_names(mm):
  with pytest.raises(jm.UnknownNameError, match="no loop 'q'"):
    mm.tile("q", 2)
  with pytest.raises(jm.UnknownNameError, match="mesh has no level 'rack'"):
    mm.tile("m", 4).parallelize("m0", "rack")
  mm.parallelize("m0", "gpu")
  with pytest.raises(jm.UnknownNameError, match="has no buffer 'D'"):
    mm.shard("D", "m0")
  with pytest.raises(jm.UnknownNameError, match="has no axis 'z'"):
    mm.shard("B", "m0", axis="z")
  with pytest.raises(jm.UnknownNameError, match="not a loop axis"):
    mm.pad("z", 2)


def test_tile_factor_must_divide(mm):
  with pytest.raises(jm.PreconditionError, match=r"tile\('n', 3\): factor must divide the loop's extent 32"):
    mm.tile("n", 3)
  with pytest.raises(jm.PreconditionError, match="already used"):
    mm.tile("n", 2, names=("m", "n1"))


def test_shift_length_and_axis_checks(mm):
  mm.tile("m", 4).parallelize("m0", "gpu")
  with pytest.raises(jm.PreconditionError, match="loop extent 48 must equal the size 4"):
    mm.shift("k", "m0")
  with pytest.raises(jm.PreconditionError, match="both loops iterate axis 'm'"):
    mm.tile("m1", 4).shift("m10", "m0")


def test_only_outer_factors_distribute(mm):
  mm.tile("m", 8, names=("ma", "mb")).tile("mb", 4, names=("mb0", "mb1"))
  with pytest.raises(jm.PreconditionError, match="only the outermost factors"):
    mm.parallelize("mb0", "gpu")


def test_buffer_split_twice_on_one_level():
  s = jm.Schedule(jm.programs.matmul(64, 32, 48), make_mesh("8"))
  s.tile("m", 8).parallelize("m0", "x")
  with pytest.raises(jm.PreconditionError, match=r"shard\('C', 'm0', axis='n'\): C is indexed by the loop's axis 'm'"):
    s.shard("C", "m0", axis="n")
  s2 = jm.Schedule(jm.programs.attention(1, 8, 8, 32, 32, 8), make_mesh("8"))
  s2.tile("i", 8).parallelize("i0", "x")
  s2.tile("j", 8).shift("j0", "i0").tile("hk", 8)
  with pytest.raises(jm.ScheduleError, match="buffer 'k' would be split over mesh level 'x' along both 'j' and 'hk'"):
    s2.shift("hk0", "i0")


def test_reorder_keeps_parallel_loops_outside(mm):
  mm.tile("m", 4).parallelize("m0", "gpu")
  with pytest.raises(jm.PreconditionError, match="parallel loops stay outside"):
    mm.reorder("k", "m0")
  with pytest.raises(jm.PreconditionError, match="named twice"):
    mm.reorder("k", "k")


def test_join_preconditions(mm):
  mm.tile("m", 4)
  with pytest.raises(jm.PreconditionError, match="different axes"):
    mm.join("m0", "n")
  mm.join("m0", "m1", name="m")
  assert [lp.name for lp in mm.loops] == ["m", "n", "k"]


def test_patch_unknown_or_unavailable_kernel(mm):
  with pytest.raises(jm.UnknownNameError, match="no local kernel 'flash9'"):
    mm.patch("flash9")
  with pytest.raises(jm.PreconditionError, match="implements"):
    mm.patch("cudnn_attention")
  att = jm.Schedule(jm.programs.attention(1, 8, 8, 32, 32, 8, dtype="bfloat16"), make_mesh("8"))
  with pytest.raises(jm.PreconditionError, match="runs on \\['gpu'\\], mesh devices are 'cpu'"):
    att.patch("cudnn_attention")


def test_bad_shardings_and_inputs():
  prog = jm.programs.matmul(64, 32, 48)
  mesh = make_mesh("8")
  with pytest.raises(jm.ScheduleError, match="one entry per input"):
    jm.Schedule(prog, mesh, in_shardings=[P()])
  with pytest.raises(jm.UnknownNameError, match="no level 'y'"):
    jm.Schedule(prog, mesh, in_shardings=[P("y"), P()])
  with pytest.raises(jm.ScheduleError, match="does not divide evenly"):
    jm.Schedule(jm.programs.matmul(60, 32, 48), mesh, in_shardings=[P("x"), P()])
  f = jm.Schedule(prog, mesh).compile()
  import jax.numpy as jnp
  with pytest.raises(jm.ScheduleError, match="input A: expected shape"):
    f(jnp.ones((32, 48)), jnp.ones((48, 32)))
  with pytest.raises(jm.ScheduleError, match="Schedule needs a jax.sharding.Mesh"):
    jm.Schedule(prog, "mesh")


def test_rejected_primitive_leaves_schedule_unchanged():
  s = jm.Schedule(jm.programs.attention(1, 8, 8, 32, 32, 8), make_mesh("8"))
  s.tile("i", 8).parallelize("i0", "x").tile("j", 8).shift("j0", "i0").tile("hk", 8)
  before = (str(s), s.to_json())
  with pytest.raises(jm.ScheduleError):
    s.shift("hk0", "i0")
  assert (str(s), s.to_json()) == before


def test_join_undoes_tile():
  s = jm.Schedule(jm.programs.weighted_sum(64, 32), make_mesh("8"))
  before = str(s)
  s.tile("i", 4).join("i0", "i1", name="i")
  assert str(s) == before
