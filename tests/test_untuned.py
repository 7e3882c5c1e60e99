"""Untuned is plain: a route nothing was measured for runs the user's own call; ``tune=True`` tunes each distinct
operator of a model once, within a time budget."""

import logging
import textwrap

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, make_mesh, rel_err, run_processes
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.analysis.hlo import compiled_collectives
from jaxmercury.tuner import calibrate, cost, stored

MACHINE = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)


class FsdpBlock(nnx.Module):
  """A block written FSDP-style: weights stored split over ``x``, gathered (``reshard``) before each einsum;
  causal GQA attention."""

  def __init__(self, mesh, d=128, heads=8, kv_heads=2, rngs=None):
    hd = d // heads
    split = NamedSharding(mesh, P("x"))
    param = lambda *shape: nnx.Param(jax.device_put(0.05 * jax.random.normal(rngs.params(), shape), split))
    self.wq, self.wk, self.wv = param(d, heads, hd), param(d, kv_heads, hd), param(d, kv_heads, hd)
    self.wo, self.w1, self.w2 = param(heads, hd, d), param(d, 4 * d), param(4 * d, d)

  def __call__(self, x):
    whole = lambda w: jax.sharding.reshard(w[...], P())
    q, k, v = (jnp.einsum("bsd,dhk->bshk", x, whole(w)) for w in (self.wq, self.wk, self.wv))
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + jnp.einsum("bshk,hkd->bsd", o, whole(self.wo))
    return x + jnp.einsum("bsf,fd->bsd", jax.nn.gelu(jnp.einsum("bsd,df->bsf", x, whole(self.w1))), whole(self.w2))


def _step(model, x):
  """The training step's compiled HLO text and loss, and the forward's result type."""
  graphdef, state = nnx.split(model)
  forward = lambda state, x: nnx.merge(graphdef, state)(x)
  step = jax.jit(jax.value_and_grad(lambda state, x: jnp.mean(forward(state, x) ** 2))).lower(state, x).compile()
  return step.as_text(), step(state, x)[0], jax.eval_shape(forward, state, x)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_untuned_fsdp_block_compiles_to_the_plain_blocks_collectives(kind, tmp_path):
  """With an empty database every attention and einsum runs as written: the routed block's training step has no
  collective the plain block's has not (before: all-gathers and collective-permutes of ring attention and
  all-gather GEMMs, 2.4x slower), computes the same loss, and its result has the plain block's type."""
  mesh = make_mesh("8", kind)
  db = jm.Database(str(tmp_path / "t.db"))
  with jax.set_mesh(mesh):
    plain = FsdpBlock(mesh, rngs=nnx.Rngs(0))
    routed = jm.distribute(FsdpBlock(mesh, rngs=nnx.Rngs(0)), mesh=mesh, database=db)
    x = jax.device_put(jax.random.normal(fresh_key(), (8, 64, 128)), NamedSharding(mesh, P("x")))
    report = jm.explain(routed, x)
    (want_text, want, want_type), (got_text, got, got_type) = _step(plain, x), _step(routed, x)
  assert [e.kind for e in report] == ["matmul"] * 3 + ["attention"] + ["matmul"] * 3
  assert report.plain == list(report) and all(e.reason == "plain (not tuned)" for e in report)
  assert str(report).splitlines()[-1] == "0 of 7 routed (0 attention, 0 matmul), 7 plain until tuned"
  counts, plain_counts = compiled_collectives(got_text), compiled_collectives(want_text)
  assert plain_counts and all(n <= plain_counts.get(kind, 0) for kind, n in counts.items()), (counts, plain_counts)
  assert float(got) == pytest.approx(float(want), rel=1e-6)
  assert got_type.shape == want_type.shape and got_type.dtype == want_type.dtype
  if kind == AxisType.Explicit:
    assert got_type.sharding.spec == want_type.sharding.spec == P("x", None, None)


def _layers(x, w1, w2, w3):
  """Two GEMMs of one program (same sizes and layouts) and a third of another (8x the columns: not near)."""
  return jnp.tanh(jnp.tanh(x @ w1) @ w2) @ w3


TUNED = ("database hit", "plain (database hit: no schedule beat it)")


def test_a_model_is_tuned_once_per_distinct_operator_within_its_budget(tmp_path, caplog, monkeypatch):
  """``tune=True``: the distinct operators, each tuned once (``operator i of n`` with its time); past the budget
  the rest run plain, reported so in the log and the report; a later call tunes what is left. The cost model is
  calibrated once for both GEMMs (one dtype; the measurement stubbed with a fixed machine's figures)."""
  mesh = make_mesh("8")
  db = jm.Database(str(tmp_path / "t.db"))
  x, w1, w2 = (jax.random.normal(fresh_key(), (16, 32)) for _ in range(3))
  w1, w2, w3 = w1.T @ w1 / 32, w2.T @ w2 / 32, jax.random.normal(fresh_key(), (32, 256))
  calibrated = []
  figures = dict(zip((calibrate.MESH, calibrate.KERNELS), MACHINE.parts()))
  monkeypatch.setattr(stored, "measure_parts", lambda program, mesh, *, parts, **kw: calibrated.append(
      (program.name, parts)) or {part: figures[part] for part in parts})
  lines = []
  options = dict(database=db, tune=True, space=0, top_k=1, iters=2, log=lines.append)
  budgeted = jm.distribute(_layers, mesh=mesh, time_budget_s=0.05, **options)  # spent by the first tune
  with caplog.at_level(logging.INFO):
    out = jax.jit(budgeted)(x, w1, w2, w3)
  assert rel_err(out, _layers(x, w1, w2, w3)) < 1e-5
  mine = [line for line in lines if line.startswith(("== operator", "== done")) or "operators tuned" in line]
  where = f"tests/test_untuned.py:{_layers.__code__.co_firstlineno + 2} (_layers)"
  assert mine[0] == f"== operator 1 of 2: matmul 16x32 32x32 at {where}"
  assert mine[1].startswith("== done in")  # the tune's own last line
  assert mine[2].startswith(f"{mine[0]}: ") and mine[2].endswith(" s") and ", in " in mine[2]
  assert mine[3] == (f"== operator 2 of 2: matmul 16x32 32x256 at {where}: not tuned, the time budget of 0.05 s "
                     "was spent; runs plain jnp.dot (XLA)")
  assert mine[4].startswith("== 1 of 2 operators tuned in ") and mine[4].endswith("; 1 not tuned")
  assert len(mine) == 5
  assert "plain (not tuned: the time budget of 0.05 s was spent)" in caplog.text  # the routing's report
  report = jm.explain(_layers, x, w1, w2, w3, mesh=mesh, database=db)  # nothing tuned here: what the database holds
  assert report[0].reason == report[1].reason in TUNED and report[2].reason == "plain (not tuned)"

  lines.clear()
  again = jm.distribute(_layers, mesh=mesh, **options)
  assert rel_err(jax.jit(again)(x, w1, w2, w3), _layers(x, w1, w2, w3)) < 1e-5
  assert [line.split(":")[0] for line in lines if line.startswith("== operator")] == ["== operator 1 of 1"] * 2
  assert sum(line.startswith("== done in") for line in lines) == 1
  assert all(e.reason in TUNED for e in jm.explain(_layers, x, w1, w2, w3, mesh=mesh, database=db))
  assert calibrated == [("matmul", (calibrate.MESH, calibrate.KERNELS))]  # the first tune's, for both


PROCESS = textwrap.dedent("""
    import json, os, sys
    pid, port, db_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import jax.numpy as jnp
    from jax.sharding import AxisType
    import jaxmercury as jm

    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    lines = []
    fn = jm.distribute(lambda x, w: jnp.tanh(x @ w), mesh=mesh, database=jm.Database(db_path), tune=True,
                       time_budget_s=0 if pid == 0 else 1e9, log=lines.append)
    shape = jax.ShapeDtypeStruct((16, 32), jnp.float32), jax.ShapeDtypeStruct((32, 32), jnp.float32)
    jax.jit(fn).lower(*shape)  # traced: its operators planned (and tuned, were the budget not spent)
    print("REPORT " + json.dumps(lines), flush=True)
    jax.distributed.shutdown()
""")


def test_processes_agree_on_a_spent_budget(tmp_path):
  """Under ``jax.distributed`` process 0's clock decides whether a tune starts: here its budget is spent, the other
  process's is not, and neither tunes (a process tuning alone would wait for the other forever)."""
  logs = run_processes(PROCESS, [[str(tmp_path / f"p{i}.db")] for i in (0, 1)], devices=4, timeout=120)
  for log, budget in zip(logs, ("0", "1e+09")):
    assert log[0].startswith("== operator 1 of 1: matmul 16x32 32x32") and log[0].endswith(
        f"not tuned, the time budget of {budget} s was spent; runs plain jnp.dot (XLA)"), log
    assert not any(line.startswith("== done") for line in log), log
