"""jaxmercury.ops: operators that use the tuned schedule for their shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, make_mesh, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.analysis.hlo import compiled_collectives

ASSUMED = jm.tuner.Machine("assumed", flops_per_s=5e9, link_bytes_per_s={"*": 3e8})  # cost-model figures


def test_untuned_ops_run_the_plain_program_then_the_stored_winner(tmp_path):
  """Nothing measured: the plain program as written (JAX's attention, nothing constrained); a stored winner: it."""
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "ops.db"))
  prog = jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True)
  db.store_machine(prog, mesh, ASSUMED)  # no calibration
  q, k, v = prog.random_inputs(fresh_key())
  want = jax.jit(prog.reference)(q, k, v)
  assert db.lookup(prog, mesh) is None
  out = jm.ops.attention(q, k, v, mesh=mesh, causal=True, database=db)
  assert rel_err(out, want) < 1e-5
  choice = jm.ops.choose(prog, mesh, database=db)
  assert choice.origin == "plain" and choice.reason == "plain (not tuned)"
  assert choice.schedule.name == "plain dot_product_attention (XLA)" and choice.schedule.in_shardings == (None,) * 3
  ring = jm.tuner.Candidate("ring", jm.library(prog, mesh)["ring"], 0.5, 1024,
                            jm.tuner.measure.Measurement(jm.tuner.measure.OK, 1.0))
  db.store(prog, mesh, ring, [ring])  # as a tune stores its winner (test_tuning_while_a_jitted_function_is_traced)
  choice = jm.ops.choose(prog, mesh, database=db)
  assert choice.origin == "database" and choice.schedule.to_json() == ring.schedule.to_json()
  assert rel_err(jm.ops.attention(q, k, v, mesh=mesh, causal=True, database=db), want) < 1e-5


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
  other = jm.programs.attention(1, 4, 2, 16, 16, 16, causal=True)  # 8x away: the plain program
  assert jm.ops.choose(other, mesh, database=db).plain


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
  assert jm.ops.choose(prog, mesh, database=db, training=True).plain  # no training record, none near
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
  """A schedule passed to the operator (a library strategy), forward and backward."""
  mesh = make_mesh("2x4")
  db = jm.Database(str(tmp_path / "ops.db"))
  a = jax.random.normal(fresh_key(), (64, 48))
  b = jax.random.normal(fresh_key(), (48, 32))
  schedule = jm.library(jm.programs.matmul(64, 32, 48), mesh)["allgather_matmul"]
  op = functools.partial(jm.ops.matmul, mesh=mesh, database=db, schedule=schedule)
  np.testing.assert_allclose(op(a, b), a @ b, rtol=2e-5, atol=2e-5)
  ga, gb = jax.grad(lambda x, y: jnp.sum(op(x, y) ** 2), argnums=(0, 1))(a, b)
  wa, wb = jax.grad(lambda x, y: jnp.sum((x @ y) ** 2), argnums=(0, 1))(a, b)
  assert rel_err(ga, wa) < 1e-5 and rel_err(gb, wb) < 1e-5


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_untuned_gemm_is_the_users_own_in_their_layouts(kind, tmp_path):
  """The plain ``jnp.dot`` in the caller's layouts: the tensor-parallel GEMMs on Explicit axes with the
  ``out_sharding`` a user must pass (ShardingTypeError before), and no collective beyond ``jnp.dot``'s own."""
  mesh = make_mesh("8", kind)
  db = jm.Database(str(tmp_path / "ops.db"))
  host = [jax.random.normal(fresh_key(), shape) for shape in ((64, 48), (48, 32))]
  out = NamedSharding(mesh, P("x", None))
  for layouts in ((P("x", None), P(None, "x")), (P(None, "x"), P("x", None))):
    with jax.set_mesh(mesh):
      a, b = (jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(host, layouts))
      routed = jax.jit(lambda a, b: jm.ops.matmul(a, b, mesh=mesh, database=db, out_sharding=out))
      plain = jax.jit(lambda a, b: jnp.dot(a, b, out_sharding=out if kind == AxisType.Explicit else None))
      y = routed(a, b)
      texts = [f.lower(a, b).compile().as_text() for f in (routed, plain)]
    assert rel_err(y, host[0] @ host[1]) < 1e-5
    assert y.sharding.spec == P("x", None) or kind == AxisType.Auto
    counts = [compiled_collectives(t) for t in texts]
    assert all(counts[0].get(c, 0) <= n for c, n in counts[1].items()) and set(counts[0]) <= set(counts[1]), counts


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
