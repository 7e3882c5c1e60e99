"""jaxmercury.ops: operators that use the tuned schedule for their shapes."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import fresh_key, make_mesh, rel_err

import jaxmercury as jm

ASSUMED = jm.tuner.Machine("assumed", flops_per_s=5e9, link_bytes_per_s={"*": 3e8})  # cost-model figures


def test_ops_use_default_then_stored_winner(tmp_path):
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "ops.db"))
  prog = jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True)
  db.store_machine(prog, mesh, ASSUMED)  # no calibration
  q, k, v = prog.random_inputs(fresh_key())
  want = jax.jit(prog.reference)(q, k, v)
  assert db.lookup(prog, mesh) is None
  out = jm.ops.attention(q, k, v, mesh=mesh, causal=True, database=db)
  assert rel_err(out, want) < 1e-5
  assert jm.ops.schedule_for(prog, mesh, database=db).to_json() == jm.library(prog, mesh)["ring"].to_json()
  out = jm.ops.attention(q, k, v, mesh=mesh, causal=True, database=db, tune=True, top_k=2, space=2, iters=2)
  assert rel_err(out, want) < 1e-5
  stored = db.lookup(prog, mesh)
  assert stored is not None
  assert jm.ops.schedule_for(prog, mesh, database=db).to_json() == stored.to_json()


def test_a_miss_takes_the_winner_of_the_nearest_sizes(tmp_path):
  """Without an exact record (and no tuning), the winner tuned for other sizes of the operator on the same mesh
  is replayed on these sizes before any library default."""
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "ops.db"))
  tuned = jm.programs.attention(1, 4, 2, 128, 128, 16, causal=True)
  tree = jm.library(tuned, mesh)["tree"]
  w = jm.tuner.Candidate("tree", tree, 0.5, 1024, jm.tuner.measure.Measurement(jm.tuner.measure.OK, 1.0))
  db.store(tuned, mesh, w, [w])
  prog = jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True)
  assert jm.ops.schedule_for(prog, mesh, database=db).trace == jm.library(prog, mesh)["tree"].trace
  q, k, v = prog.random_inputs(fresh_key())
  assert rel_err(jm.ops.attention(q, k, v, mesh=mesh, causal=True, database=db), prog.reference(q, k, v)) < 1e-5
  other = jm.programs.attention(1, 4, 2, 16, 16, 16, causal=True)  # 8x away: the library default
  assert jm.ops.schedule_for(other, mesh, database=db).trace == jm.library(other, mesh)["ring"].trace


def test_training_objective_has_its_own_winners(tmp_path):
  """``training=True`` reads (and tunes) the training step's records; the forward's records, and their nearest
  sizes, are not taken for it, nor its records for the forward."""
  from jaxmercury.tuner.database import TRAINING
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "ops.db"))
  prog = jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True)
  lib = jm.library(prog, mesh)
  ok = jm.tuner.measure.Measurement(jm.tuner.measure.OK, 1.0)
  tree = jm.tuner.Candidate("tree", lib["tree"], 0.5, 1024, ok)
  db.store(prog, mesh, tree, [tree])  # the forward's winner
  assert jm.ops.schedule_for(prog, mesh, database=db).trace == lib["tree"].trace
  default = jm.ops.schedule_for(prog, mesh, database=db, training=True)
  assert default.trace == lib["ring"].trace  # no training record, none near: the library default
  cp = jm.tuner.Candidate("context_parallel", lib["context_parallel"], 0.5, 1024, ok)
  db.store(prog, mesh, cp, [cp], objective=TRAINING)
  assert jm.ops.schedule_for(prog, mesh, database=db, training=True).trace == lib["context_parallel"].trace
  assert jm.ops.schedule_for(prog, mesh, database=db).trace == lib["tree"].trace
  near = jm.programs.attention(1, 4, 2, 128, 128, 16, causal=True)
  assert jm.ops.schedule_for(near, mesh, database=db, training=True).trace == (
      jm.library(near, mesh)["context_parallel"].trace)
  q, k, v = prog.random_inputs(fresh_key())
  out = jm.ops.attention(q, k, v, mesh=mesh, causal=True, database=db, training=True)
  assert rel_err(out, prog.reference(q, k, v)) < 1e-5


def test_ops_matmul_is_differentiable(tmp_path):
  mesh = make_mesh("2x4")
  db = jm.Database(str(tmp_path / "ops.db"))
  a = jax.random.normal(fresh_key(), (64, 48))
  b = jax.random.normal(fresh_key(), (48, 32))
  np.testing.assert_allclose(jm.ops.matmul(a, b, mesh=mesh, database=db), a @ b, rtol=2e-5, atol=2e-5)
  ga, gb = jax.grad(lambda x, y: jnp.sum(jm.ops.matmul(x, y, mesh=mesh, database=db) ** 2), argnums=(0, 1))(a, b)
  wa, wb = jax.grad(lambda x, y: jnp.sum((x @ y) ** 2), argnums=(0, 1))(a, b)
  assert rel_err(ga, wa) < 1e-5 and rel_err(gb, wb) < 1e-5


def test_default_schedule_patches_the_preferred_kernel_that_applies(tmp_path, monkeypatch):
  """On CPUs no preferred kernel applies (XLA's body); in interpret mode a Pallas one does, once preferred."""
  import dataclasses

  from jaxmercury.kernels import registry
  pallas = registry._KERNELS["pallas_attention"]
  monkeypatch.setitem(registry._KERNELS, "pallas_attention", dataclasses.replace(pallas, preference=1))
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "ops.db"))
  prog = jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True)
  assert jm.ops.schedule_for(prog, mesh, database=db).kernel is None
  with registry.interpret_mode():
    s = jm.ops.schedule_for(prog, mesh, database=db)
    assert s.kernel == "pallas_attention"
    xs = prog.random_inputs(fresh_key())
    assert rel_err(s.compile()(*xs), prog.reference(*xs)) < 1e-4


def test_tuning_while_a_jitted_function_is_traced(tmp_path):
  """A model tuned on its first call under jax.jit (the usual training loop): the tuner measures real arrays in a
  thread of its own, not the trace's tracers, and the traced function gets the winner; a second call of the same
  operator in the trace finds it in the database (which the tuner's thread wrote)."""
  mesh, db = make_mesh("8"), jm.Database(tmp_path / "t.db")
  prog = jm.programs.matmul(64, 32, 48)
  db.store_machine(prog, mesh, ASSUMED)  # no calibration
  a, b = prog.random_inputs(fresh_key())
  lines = []

  def product(a, b):
    return jm.ops.matmul(a, b, mesh=mesh, database=db, tune=True, space=0, top_k=1, iters=2, log=lines.append)

  out = jax.jit(lambda a, b: product(a, b) - 0.5 * product(a, b))(a, b)
  assert rel_err(out, 0.5 * prog.reference(a, b)) < 1e-5
  assert sum(line.startswith("== done") for line in lines) == 1, lines
  timed = [line for line in lines if line.lstrip().startswith("[")]
  assert timed and all(" ok " in line for line in timed), lines
  assert lines[-1].startswith("== done in") and "winner" in lines[-1]
