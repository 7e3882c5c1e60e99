"""The autotuner on the simulated CPU mesh: search, database, fault handling, memory, cost model, plot.

Programs are small and every tuning run times a few candidates with two
iterations, so the whole file runs in about a minute on two cores.
"""

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches, fresh_key, make_mesh
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

import jaxmercury as jm
from jaxmercury.analysis import memory
from jaxmercury.kernels import registry
from jaxmercury.tuner import accuracy, calibrate, cost, decide, measure, plot, propose
from jaxmercury.tuner import autotuner as tune_module
from jaxmercury.tuner.autotuner import TuneResult
from jaxmercury.tuner.candidates import Candidate
from jaxmercury.tuner.plain import plain_programs
from jaxmercury.tuner.reference import trial

# A fixed, rough CPU machine: tests that are not about calibration need not pay for it.
CPU = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)

PROGRAMS = {
    "attention": lambda: jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True),
    "matmul": lambda: jm.programs.matmul(64, 128, 256),
}


def _quiet(_):
  pass


def _tune(prog, mesh, **kwargs):
  kwargs = {"space": 4, "top_k": 2, "iters": 2, "machine": CPU, "key": fresh_key(), "log": _quiet, **kwargs}
  return jm.autotune(prog, mesh, **kwargs)


def _by_status(result, status):
  return [c for c in result.candidates if c.status == status]


# ------------------------------------------------------------------ the search
@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("prog_name", sorted(PROGRAMS))
def test_autotune_picks_the_fastest_correct_candidate(prog_name, mesh_name):
  prog, mesh = PROGRAMS[prog_name](), make_mesh(mesh_name)
  top_k = 2
  result = _tune(prog, mesh, top_k=top_k)
  assert not result.from_database and result.machine == CPU
  assert set(jm.library(prog, mesh)) <= {c.name for c in result.candidates}

  ok, failed, pruned = (_by_status(result, s) for s in (measure.OK, measure.FAILED, measure.PRUNED))
  assert len(ok) + len(failed) + len(pruned) == len(result.candidates)
  assert not failed, "\n".join(f"{c.name}: {c.result.reason}" for c in failed)
  # The plain program is timed, and the cost model's top_k best predicted within the margin of the best.
  (plain,) = [c for c in ok if c.plain]
  assert plain.origin == "plain" and plain.name.startswith("plain ") and math.isnan(plain.predicted_ms)
  others = [c for c in ok if not c.plain]
  _assert_top_k_timed(result, others, top_k)
  tol = measure.tolerance(prog.writes.dtype)
  for c in ok:
    assert c.result.rel_err is not None and c.result.rel_err < tol, c.name
    assert len(c.result.times_ms) == 2 and all(t > 0 for t in c.result.times_ms)
    assert math.isfinite(c.time_ms) and c.time_ms > 0
  # The winner comes from the final round, which the plain program is in: every finalist faster there is tied
  # with it within the noise. Without a final round (the plain program alone close to the best), on own times.
  assert result.baseline is plain
  finalists = [c for c in ok if c.final_ms is not None]
  if finalists:
    assert plain in finalists and result.best in finalists
    assert all(c in result.tied for c in finalists if c.final_ms < result.best.final_ms)
    assert result.speedup_vs_baseline == pytest.approx(plain.final_ms / result.best.final_ms)
  else:
    assert result.best is plain is min(ok, key=lambda c: c.time_ms), result.decision

  # Every pruned candidate has a reason: the same program as a timed one, the cost model ranks it below the top_k
  # timed, or predicts it over the margin of the best.
  assert pruned
  ranked_out = [c for c in pruned if f"top {top_k}" in c.result.reason or "the best prediction" in c.result.reason]
  for c in pruned:
    assert c in ranked_out or c.result.reason.startswith("same program as "), c.result.reason
  assert max(c.predicted_ms for c in others) <= min(c.predicted_ms for c in ranked_out)

  # Re-run the winner and another passing candidate on fresh inputs, against the reference.
  for c in [result.best] + [c for c in ok if c is not result.best][:1]:
    assert_matches(c.schedule, inputs=prog.random_inputs(fresh_key()))
  assert result.table().count("\n") == len(result.candidates) + 1


def _dot_block(ctx, a, b):
  del ctx
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _assert_top_k_timed(result, others, top_k):
  """``top_k`` candidates besides the plain programs are timed, fewer only where the rest are predicted over
  ``TuneConfig.margin`` times the best prediction (and pruned so, with the ratio)."""
  margin = jm.TuneConfig().margin
  slow = [c for c in _by_status(result, measure.PRUNED) if "the best prediction" in c.result.reason]
  for c in slow:
    best = min((b for b in result.candidates if c.result.reason.endswith(f"({b.name})")), key=lambda b: b.predicted_ms)
    assert c.predicted_ms > margin * best.predicted_ms, (c.name, c.predicted_ms, best.name)
    assert f"{c.predicted_ms / best.predicted_ms:.1f}x the best prediction" in c.result.reason
  assert len(others) == top_k or (len(others) < top_k and slow)


def _two_kernels(monkeypatch):
  """``test_dot`` registered beside ``xla`` for this test only, and a machine that gives it 4x xla's rate."""
  monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
  registry.register(registry.Kernel(name="test_dot", patterns=frozenset({"matmul"}),
                                    make=lambda program, config, interpret: _dot_block))
  return cost.Machine("test CPU, two kernels", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6,
                      kernel_flops_per_s={"xla": 10e9, "test_dot": 40e9})


def _observed(db, mesh, kernels: dict):
  """A winner's record of another program on ``mesh`` whose candidates ran ``kernels[name]`` times as long as
  predicted, three of each."""
  prog = jm.programs.matmul(32, 32, 32)
  s = jm.library(prog, mesh)["allgather_matmul"]
  cands = []
  for kernel, ratio in kernels.items():
    patched = s if kernel == "xla" else s.copy().patch(kernel)
    cands += [Candidate("allgather_matmul", patched, 1.0, 1, measure.Measurement(measure.OK, ratio, [ratio]))] * 3
  db.store(prog, mesh, cands[0], cands)


def test_corrections_learned_from_the_database_rank_each_kernel_by_its_measured_times(tmp_path, monkeypatch):
  """test_dot is predicted 4x faster than xla; the database saw it run 20x its predictions and xla 2x: corrected,
  it is predicted 2.5x slower, over the margin: pruned, never compiled. Without the database it is timed."""
  machine = _two_kernels(monkeypatch)
  prog, mesh = PROGRAMS["matmul"](), make_mesh("8")
  db = jm.Database(tmp_path / "t.db")
  _observed(db, mesh, {"xla": 2.0, "test_dot": 20.0})
  assert accuracy.Corrections.learned(db.observations(mesh)).factors == pytest.approx({"xla": 2.0, "test_dot": 20.0})
  lines = []
  result = _tune(prog, mesh, machine=machine, top_k=3, database=db, log=lines.append)
  assert result.corrections.factors == pytest.approx({"xla": 2.0, "test_dot": 20.0})
  assert any(line.startswith("cost model corrections: test_dot x20.00, xla x2.00") for line in lines), lines
  timed = [c for c in result.candidates if c.status == measure.OK and not c.plain]
  assert timed and all(c.kernel in (None, "xla") for c in timed)
  fast = [c for c in result.candidates if c.kernel == "test_dot"]
  assert fast and all(c.status == measure.PRUNED for c in fast)
  assert any("the best prediction" in c.result.reason for c in fast)
  alone = _tune(prog, mesh, machine=machine, top_k=3)
  assert all(c.kernel == "test_dot" for c in alone.candidates if c.status == measure.OK and not c.plain)
  assert alone.corrections.seen == 0


def test_rank_agreement():
  assert accuracy.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert accuracy.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
  assert accuracy.spearman([1, 1, 2, 3], [3, 2, 1, 0]) == pytest.approx(-0.9486833)  # tied ranks shared
  assert accuracy.spearman([1, 2], [1, 2]) is None and accuracy.spearman([1, 1, 1], [1, 2, 3]) is None
  c = accuracy.Corrections.learned([("a", 1.0, 2.0)] * 3 + [("b", 1.0, 8.0)] * 2)
  assert c.factors == {"a": pytest.approx(2.0)} and c.default == pytest.approx(2.0) and c.seen == 5


@pytest.mark.parametrize("mesh_name", ["1", "8"])
def test_candidates_predicted_several_times_slower_are_not_compiled(mesh_name, monkeypatch):
  """A kernel with a quarter of the rate is predicted 4x slower: pruned with the ratio, not compiled, library
  strategy or not."""
  machine = _two_kernels(monkeypatch)
  machine = dataclasses.replace(machine, kernel_flops_per_s={"xla": 40e9, "test_dot": 10e9})
  mesh = make_mesh(mesh_name) if mesh_name != "1" else jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))
  prog = PROGRAMS["matmul"]()
  compiled = []
  original = measure.compile_ahead
  monkeypatch.setattr(measure, "compile_ahead", lambda s, **kw: compiled.append(s) or original(s, **kw))
  result = _tune(prog, mesh, machine=machine, top_k=8)
  slow = [c for c in result.candidates if c.result and "the best prediction" in c.result.reason]
  assert any("[test_dot]" in c.name for c in slow)
  assert all(c.status == measure.PRUNED for c in result.candidates if "[test_dot]" in c.name)
  assert not {id(c.schedule) for c in slow} & {id(s) for s in compiled}
  _assert_top_k_timed(result, [c for c in result.candidates if c.status == measure.OK and not c.plain], 8)


# ------------------------------------------------------------------ the database
def test_database_returns_the_stored_winner_without_compiling(tmp_path, monkeypatch):
  prog, mesh = PROGRAMS["matmul"](), make_mesh("2x4")
  db = jm.Database(tmp_path / "t.db")
  monkeypatch.setattr(decide, "FINAL_MARGIN", 1e9)  # a final round always: its notes must round-trip too
  first = _tune(prog, mesh, machine=None, database=db)  # calibrates, then stores figures and winner
  assert first.best is not None and not first.from_database
  assert len(db) == 1
  _assert_calibrated(first.machine, mesh)
  assert db.machine(prog, mesh) == first.machine

  def forbidden(*args, **kwargs):
    raise AssertionError("a database hit must not calibrate, compile or measure")

  monkeypatch.setattr(measure, "measure", forbidden)
  monkeypatch.setattr(jm.Schedule, "compile", forbidden)
  monkeypatch.setattr(calibrate, "calibrate", forbidden)
  monkeypatch.setattr(tune_module, "calibrate", forbidden, raising=False)
  again = jm.Database(tmp_path / "t.db")  # a new connection: the record is on disk
  second = jm.autotune(prog, mesh, database=again, log=_quiet)

  assert second.from_database and second.decision == first.decision == first.best.final.note
  assert second.best.schedule.to_json() == first.best.schedule.to_json()
  assert (second.best.name, second.best.time_ms, second.best.memory_bytes) == (
      first.best.name, first.best.time_ms, first.best.memory_bytes)
  assert any(c is second.best for c in second.candidates)
  assert second.table() == first.table()
  assert [c.to_dict() for c in second.candidates] == [c.to_dict() for c in first.candidates]
  assert again.lookup(prog, mesh).to_json() == first.best.schedule.to_json()

  # Another program (other parameters) or another mesh is a miss.
  assert again.lookup_record(jm.programs.matmul(64, 128, 128), mesh) is None
  assert again.lookup_record(jm.programs.matmul(64, 128, 256, dtype=jnp.bfloat16), mesh) is None
  assert again.lookup_record(prog, make_mesh("4x2")) is None
  assert again.lookup_record(prog, make_mesh("8")) is None
  rows = PartitionSpec(("node", "gpu"), None)
  assert again.lookup_record(prog, mesh, layouts=((rows, PartitionSpec()), rows)) is None
  assert again.machine(prog, make_mesh("8")) is None


def test_a_tune_also_times_the_nearest_sizes_winner(tmp_path):
  """The winner stored for other sizes (not among this tune's candidates) is timed too, under its own name."""
  mesh = make_mesh("8")
  db = jm.Database(tmp_path / "t.db")
  tuned = jm.programs.matmul(64, 128, 128)
  mine = jm.Schedule(tuned, mesh).tile("k", 2)  # a local schedule no library strategy or sampled one is
  w = Candidate("mine", mine, 0.5, 1024, measure.Measurement(measure.OK, 1.0))
  db.store(tuned, mesh, w, [w])
  prog = PROGRAMS["matmul"]()  # k = 256: 2x away
  lines = []
  result = _tune(prog, mesh, database=db, space=0, top_k=0, log=lines.append)
  (near,) = [c for c in result.candidates if c.name == "mine (tuned at k=128)"]
  assert near.status == measure.OK and near.time_ms > 0, near.result.reason
  assert near.schedule.trace == mine.trace and near.schedule.program is prog
  assert any(line.startswith("also timing mine (tuned at k=128)") for line in lines)
  assert db.lookup(prog, mesh) is not None  # this tune's own winner is stored for its sizes


# ------------------------------------------------------------------ fault injection
@pytest.fixture
def bad_kernels(monkeypatch):
  """The kernels that raise, return NaNs or are 1% off (tests/fault_kernels.py), registered for one test."""
  monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
  import fault_kernels
  fault_kernels.install()
  return ["test_nan", "test_raises", "test_wrong"]


def test_faulty_kernels_fail_with_a_reason_and_never_win(bad_kernels):
  prog, mesh = PROGRAMS["matmul"](), make_mesh("8")
  lib = jm.library(prog, mesh)
  pairs = list(lib.items())
  for base in ("allgather_matmul", "async_tp"):  # one without a ring, one with
    pairs += [(f"{base} [{k}]", lib[base].copy().patch(k)) for k in bad_kernels]
  result = _tune(prog, mesh, candidates=pairs, top_k=len(pairs))
  by_name = {c.name: c for c in result.candidates}
  assert len(by_name) == len(pairs) + 1 and by_name[result.baseline.name].plain

  for base in ("allgather_matmul", "async_tp"):
    raised, nan, wrong = (by_name[f"{base} [{k}]"] for k in ("test_raises", "test_nan", "test_wrong"))
    assert raised.status == measure.FAILED and "injected kernel fault" in raised.result.reason
    assert nan.status == measure.FAILED and "NaN" in nan.result.reason
    assert wrong.status == measure.FAILED and wrong.result.reason.startswith("wrong result")
    assert wrong.result.rel_err == pytest.approx(0.01, rel=0.05)
    for c in (raised, nan, wrong):
      assert c.time_ms is None and not c.result.times_ms
  for name in lib:
    assert by_name[name].status == measure.OK, by_name[name].result.reason
  assert result.best.plain or (result.best.name in lib and result.best.schedule.kernel is None)


def test_time_limit_fails_a_slow_candidate():
  prog, mesh = PROGRAMS["matmul"](), make_mesh("8")
  pair = ("allgather_matmul", jm.library(prog, mesh)["allgather_matmul"])
  tight = _tune(prog, mesh, candidates=[pair], top_k=1, time_limit_s=1e-6)
  assert len(tight.candidates) == 2  # the plain program too
  for c in tight.candidates:
    assert c.status == measure.FAILED and c.result.reason.startswith("time-out"), c.result.reason
  assert tight.best is None
  generous = _tune(prog, mesh, candidates=[pair], top_k=1, time_limit_s=300.0)
  assert generous.best is not None and generous.best.status == measure.OK


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("prog_name", sorted(PROGRAMS))
def test_memory_estimate_is_within_4x_of_compiled(prog_name, mesh_name):
  prog, mesh = PROGRAMS[prog_name](), make_mesh(mesh_name)
  xs = prog.random_inputs(fresh_key())
  lib = jm.library(prog, mesh)
  assert len(lib) >= 3
  for name, s in lib.items():
    compiled = measure.compiled_memory(s.compile().lower(*xs).compile())
    if compiled is None:
      pytest.skip("this backend's compiled.memory_analysis() reports nothing")
    estimate = memory.memory_per_device(s)
    assert compiled / 4 <= estimate <= 4 * compiled, f"{name}: estimated {estimate} B, compiled {compiled} B"


def test_memory_budget_below_the_library_finds_a_leaner_schedule():
  # Long keys, few queries: every library strategy keeps whole rows of scores or rings K and V;
  # design-space schedules that ring the queries instead need less.
  prog, mesh = jm.programs.attention(1, 1, 1, 64, 4096, 4), make_mesh("2x4")
  xs = prog.random_inputs(fresh_key())
  lib = jm.library(prog, mesh)
  lib_estimate = {n: memory.memory_per_device(s) for n, s in lib.items()}
  lib_compiled = {n: measure.compiled_memory(s.compile().lower(*xs).compile()) for n, s in lib.items()}
  if None in lib_compiled.values():
    pytest.skip("this backend's compiled.memory_analysis() reports nothing")
  budget = min(lib_estimate.values()) - 1

  result = _tune(prog, mesh, memory_budget=budget, space=24, top_k=2)
  for c in result.candidates:
    if c.name in lib:
      assert c.status == measure.PRUNED and "over the budget" in c.result.reason
  best = result.best
  assert best is not None and best.name not in lib
  assert best.memory_bytes <= budget
  assert best.result.compiled_bytes < min(lib_compiled.values()), (best.name, best.result.compiled_bytes,
                                                                   lib_compiled)


# ------------------------------------------------------------------ cost model
def test_cost_model_plans_a_larger_abstract_mesh():
  mesh = AbstractMesh((4, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
  fast = cost.Machine("fast links", 600e12, {"*": 400e9}, 20e-6)
  slow = fast.with_links(node=12.5e9)
  assert (slow.bandwidth("node"), slow.bandwidth("gpu"), fast.bandwidth("node")) == (12.5e9, 400e9, 400e9)
  cases = [(jm.programs.attention(1, 16, 16, 8192, 8192, 64, causal=True, dtype=jnp.bfloat16), {"ring", "usp"}),
           (jm.programs.matmul(8192, 8192, 8192, dtype=jnp.bfloat16), {"async_tp", "async_tp_reducescatter"})]
  for prog, rings in cases:
    lib = jm.library(prog, mesh)
    assert rings <= set(lib)
    for name, s in lib.items():
      with pytest.raises(jm.ScheduleError):
        s.compile()
      t_fast, t_slow = cost.predict(s, fast), cost.predict(s, slow)
      assert 0 < t_fast < math.inf and memory.memory_per_device(s) > 0
      assert t_slow >= t_fast, name
      if name in rings:
        assert t_slow > 1.2 * t_fast, f"{name}: {t_fast:.3e} s with fast links, {t_slow:.3e} s with slow"


def test_abstract_mesh_plans_like_the_real_one():
  real = make_mesh("2x4")
  abstract = AbstractMesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
  prog = PROGRAMS["attention"]()
  real_lib, abstract_lib = jm.library(prog, real), jm.library(prog, abstract)
  assert set(real_lib) == set(abstract_lib)
  for name, s in real_lib.items():
    a = abstract_lib[name]
    assert cost.predict(a, CPU) == cost.predict(s, CPU)
    assert memory.memory_per_device(a) == memory.memory_per_device(s)


def test_predict_candidates_on_an_abstract_mesh():
  mesh = AbstractMesh((4, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
  prog = jm.programs.attention(1, 16, 16, 8192, 8192, 64, causal=True, dtype=jnp.bfloat16)
  machine = cost.Machine("two kernels", 600e12, {"*": 400e9}, 20e-6,
                         kernel_flops_per_s={"xla": 300e12, "cudnn_attention": 600e12})
  cands = tune_module.predict_candidates(prog, mesh, machine.with_links(node=12.5e9), space=6)
  times = [c.predicted_ms for c in cands]
  assert times == sorted(times) and all(0 < t < math.inf for t in times)
  names = {c.name for c in cands}
  for name in jm.library(prog, mesh):
    assert {name, f"{name} [cudnn_attention]"} <= names
  by_name = {c.name: c for c in cands}
  # The faster kernel shortens ulysses (whole causal blocks, square) and the tree (its key blocks are shorter than
  # its query blocks: cuDNN takes their partly visible causal blocks with a bias, densely).
  assert by_name["ulysses [cudnn_attention]"].predicted_ms < by_name["ulysses"].predicted_ms
  assert by_name["tree [cudnn_attention]"].predicted_ms < by_name["tree"].predicted_ms
  assert by_name["ring [cudnn_attention]"].schedule.kernel == "cudnn_attention"


def _assert_calibrated(m, mesh):
  """Figures a calibration on ``mesh`` must have: positive and finite, one bandwidth per level."""
  positive = [m.flops_per_s, m.latency_s, m.gather_factor, m.memory_bytes_per_s,
              *m.link_bytes_per_s.values(), *m.kernel_flops_per_s.values()]
  assert all(math.isfinite(f) and f > 0 for f in positive), m
  assert math.isfinite(m.call_overhead_s) and m.call_overhead_s >= 0, m  # an intercept: may round to 0
  assert 0 <= m.overlap <= 1, m
  assert set(m.link_bytes_per_s) == {*mesh.axis_names, "*"} and set(m.kernel_flops_per_s) == {"xla"}
  assert cost.Machine.from_dict(m.to_dict()) == m


def test_calibrate_measures_positive_finite_figures():
  prog, mesh = PROGRAMS["attention"](), make_mesh("8")
  m = calibrate.calibrate(prog, mesh)
  _assert_calibrated(m, mesh)
  for s in jm.library(prog, mesh).values():
    assert 0 < cost.predict(s, m) < math.inf


# ------------------------------------------------------------------ plot
def test_pareto_front():
  points = [(1, 5, "a"), (2, 3, "b"), (2, 4, "c"), (3, 3, "d"), (4, 1, "e"), (0.5, 9, "f"), (5, 2, "g"),
            (1, 5, "a again"), (6, math.nan, "no time"), (0.1, None, "pruned")]
  expected = [(0.5, 9, "f"), (1, 5, "a"), (2, 3, "b"), (4, 1, "e")]
  assert plot.pareto_front(points) == expected
  assert plot.pareto_front(list(reversed(points[:8]))) == [(0.5, 9, "f"), (1, 5, "a again"), (2, 3, "b"),
                                                           (4, 1, "e")]
  assert plot.pareto_front([(3, 2)]) == [(3, 2)]
  assert plot.pareto_front([]) == []


def _hand_made_result():
  """A TuneResult with every status, from library schedules and made-up times (nothing compiled)."""
  prog, mesh = PROGRAMS["matmul"](), make_mesh("8")
  cands = []
  for n, (name, s) in enumerate(jm.library(prog, mesh).items()):
    status = [measure.OK, measure.OK, measure.FAILED, measure.PRUNED][n % 4]
    result = (measure.Measurement(status, 1.0 + n, [1.0 + n], 1e-7) if status == measure.OK
              else measure.Measurement(status, reason="made up"))
    cands.append(Candidate(name, s, 0.5 + n, memory.memory_per_device(s), result))
  (plain,) = plain_programs(prog, mesh)
  cands.append(Candidate(plain.name, plain, math.nan, plain.memory_bytes(),
                         measure.Measurement(measure.OK, 1.5, [1.5], 1e-7), origin="plain"))
  return TuneResult(cands[0], cands, machine=CPU)


def test_the_table_and_the_plot_mark_the_plain_programs():
  result = _hand_made_result()
  rows = {line.split(" | ")[0].strip("| "): line for line in result.table().splitlines()[2:]}
  assert "| plain jnp.dot (XLA) | plain |  | 1.500 |" in rows["plain jnp.dot (XLA)"]
  assert result.baseline.name == "plain jnp.dot (XLA)" and "| winner" in rows[result.best.name]
  figure = pytest.importorskip("matplotlib.figure")
  ax = figure.Figure().add_subplot()
  plot._scatter(ax, result)
  plot._labels(ax, [(1.0, 1.5, c) for c in result.candidates if c.plain])
  labels = [h.get_label() for h in ax.collections]
  assert "plain program (measured)" in labels and "measured" in labels
  assert [t.get_text() for t in ax.texts] == ["plain jnp.dot (XLA)"]


def test_latency_memory_plot_writes_a_png(tmp_path):
  pytest.importorskip("matplotlib")
  path = plot.latency_memory_plot(_hand_made_result(), tmp_path / "design_space.png", title="matmul")
  data = (tmp_path / "design_space.png").read_bytes()
  assert path == tmp_path / "design_space.png"
  assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
  width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
  assert (width, height) == (1125, 750)  # 7.5 x 5 inches at 150 dpi


def test_latency_memory_plot_without_matplotlib(tmp_path, monkeypatch):
  for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
    monkeypatch.setitem(sys.modules, name, None)  # makes `import matplotlib...` raise ImportError
  with pytest.raises(RuntimeError, match="pip install matplotlib"):
    plot.latency_memory_plot(_hand_made_result(), tmp_path / "x.png")
  assert not (tmp_path / "x.png").exists()


def test_kernel_variants_take_their_kernels_measured_rate():
  from jaxmercury.kernels.attention.mosaic import ForwardConfig
  machine = cost.Machine("rates", 100e12, {"*": 400e9}, 20e-6,
                         kernel_flops_per_s={"k": 500e12, "k(block_q=128)": 450e12})
  assert machine.rate("k", ForwardConfig(block_q=128)) == 450e12
  assert machine.rate("k", ForwardConfig(block_kv=64)) == 500e12  # not measured: its kernel's rate
  assert machine.rate("k", ForwardConfig()) == machine.rate("k") == 500e12
  assert machine.rate("other") == 100e12


def test_close_candidates_are_ranked_by_a_side_by_side_final_round(monkeypatch):
  """Candidates within FINAL_MARGIN of the best are re-timed interleaved with the plain program; the winner comes
  from those times: no finalist is faster there beyond the noise."""
  monkeypatch.setattr(decide, "FINAL_MARGIN", 1e9)  # every timed candidate is a finalist
  lines = []
  result = jm.autotune(jm.programs.matmul(64, 64, 64), make_mesh("8"), space=0, top_k=2, iters=3, log=lines.append)
  finalists = [c for c in result.candidates if c.final_ms is not None]
  assert 2 <= len(finalists) <= decide.FINAL_SIZE + 1 and any(c.plain for c in finalists)
  assert all(len(c.result.times_ms) == 3 and len(c.final.times_ms) >= 4 and c.final.note for c in finalists)
  assert result.best in finalists and result.best.final_ms is not None
  assert all(c in result.tied for c in finalists if c.final_ms < result.best.final_ms)
  assert any(line.startswith("  final round (interleaved):") for line in lines)
  assert any(line.startswith("decision: ") for line in lines)


@pytest.mark.parametrize("prog_name", sorted(PROGRAMS))
def test_training_tune_checks_gradients_times_steps_and_keeps_its_own_record(prog_name, tmp_path, monkeypatch):
  """``training=True``: candidates ranked by forward plus backward, checked on the output and each input's
  gradient, timed as one forward-and-backward call; the record is the training objective's, not the forward's."""
  from jaxmercury.tuner.database import TRAINING
  prog, mesh = PROGRAMS[prog_name](), make_mesh("8")
  db = jm.Database(tmp_path / "t.db")
  steps = []
  real = measure.training_step
  monkeypatch.setattr(measure, "training_step", lambda fn: steps.append(fn) or real(fn))
  lib = jm.library(prog, mesh)
  picks = ("ring", "context_parallel") if prog_name == "attention" else ("allgather_matmul", "matmul_reducescatter")
  options = {"candidates": [(name, lib[name]) for name in picks], "space": 0}
  result = _tune(prog, mesh, database=db, training=True, **options)
  ok = _by_status(result, measure.OK)
  assert result.best is not None and ok and len(steps) >= len(ok)
  for c in result.candidates:
    if c.status != measure.FAILED and not c.plain:
      assert c.predicted_ms == pytest.approx(1e3 * (cost.predict(c.schedule, CPU)
                                                     + cost.backward_seconds(c.schedule, CPU)))
  assert db.lookup(prog, mesh) is None  # the forward objective has no record
  assert db.lookup(prog, mesh, objective=TRAINING).to_json() == result.best.schedule.to_json()
  assert db.measurements(prog, mesh) == {} and db.measurements(prog, mesh, objective=TRAINING)
  again = _tune(prog, mesh, database=db, training=True, **options)
  assert again.from_database and again.best.schedule.to_json() == result.best.schedule.to_json()
  forward = _tune(prog, mesh, database=db, **options)  # the forward objective tunes on its own
  assert not forward.from_database and db.lookup(prog, mesh) is not None


def test_a_training_tune_ranks_on_forwards_and_compiles_the_steps_of_its_finalists_only(tmp_path, monkeypatch):
  """More candidates than ``training_finalists``: their forwards are measured (and stored under the forward
  objective), then only the best of them and the plain program have their training steps compiled and timed."""
  from jaxmercury.tuner.database import TRAINING
  prog, mesh = PROGRAMS["matmul"](), make_mesh("8")
  db = jm.Database(tmp_path / "t.db")
  steps, lines = [], []
  real = measure.training_step
  monkeypatch.setattr(measure, "training_step", lambda fn: steps.append(fn) or real(fn))
  result = _tune(prog, mesh, database=db, training=True, space=4, top_k=3, margin=100.0, training_finalists=1,
                 log=lines.append)
  assert any("ranking 3 candidates on their forwards first" in line for line in lines), lines
  forwards = db.measurements(prog, mesh)  # the forward objective's: each of the three, none of the plain program
  assert len(forwards) == 3 and all(m.result.status == measure.OK for m in forwards.values())
  stepped = [c for c in result.candidates if c.status == measure.OK]
  assert len(stepped) == 2 and any(c.plain for c in stepped) and len(steps) == 2
  out = [c for c in result.candidates if c.result and "training finalists" in c.result.reason]
  assert len(out) == 2 and all(c.status == measure.PRUNED for c in out)
  assert all(r.result is not None for r in db.measurements(prog, mesh, objective=TRAINING).values())
  assert db.lookup(prog, mesh, objective=TRAINING) is not None


def test_a_wrong_gradient_fails_the_candidate_with_the_buffer_named():
  """The training check can fail: a reference whose dk is off by half fails the candidate, naming dk."""
  prog, mesh = PROGRAMS["attention"](), make_mesh("8")
  schedule = jm.library(prog, mesh)["ring"]
  inputs, cot, (out, grads) = trial(prog, 7, mesh.devices.flat[0], training=True)
  good = measure.measure(schedule, inputs, (out, grads), iters=1, cotangent=cot)
  assert good.status == measure.OK and good.rel_err < measure.tolerance(prog.writes.dtype)
  bad = measure.measure(schedule, inputs, (out, (grads[0], 1.5 * grads[1], grads[2])), iters=1, cotangent=cot)
  assert bad.status == measure.FAILED and bad.reason.startswith("wrong gradient dk: relative error")


def test_a_training_reference_is_one_compiled_program_and_stays_on_a_one_device_mesh():
  """The trusted output, gradients and cotangent of a training trial compile as one program besides the inputs'
  draw (op by op they compiled five); with ``on_device`` they stay on the device and check as the host copy does."""
  from jaxmercury.tuner.reference import trial
  prog, device = jm.programs.matmul(96, 80, 48, dtype="bfloat16"), jax.devices()[0]
  trial(jm.programs.matmul(32, 16, 48, dtype="bfloat16"), 5, device, training=True)  # what any first trial compiles
  compiles = []
  listener = lambda event, secs, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    inputs, cot, (out, grads) = trial(prog, 5, device, training=True, on_device=True)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert len(compiles) <= 2, compiles
  assert all(isinstance(x, jax.Array) and x.devices() == {device} for x in (out, *grads))
  _, _, (host_out, host_grads) = trial(prog, 5, device, training=True)
  assert isinstance(host_out, np.ndarray)
  y = jax.jit(prog.reference)(*inputs)
  assert measure.local_error(y, out) == measure.local_error(y, host_out)
  np.testing.assert_array_equal(np.asarray(grads[1]), host_grads[1])


def test_a_training_tune_in_worker_processes():
  """``isolation="process"`` measures training steps in the worker too."""
  prog, mesh = PROGRAMS["matmul"](), make_mesh("8")
  result = _tune(prog, mesh, training=True, isolation="process", space=0, top_k=1,
                 candidates=[("allgather_matmul", jm.library(prog, mesh)["allgather_matmul"])])
  assert [c.origin for c in result.candidates] == ["plain", "given"]
  for c in result.candidates:  # the plain program rebuilt in the worker from its description
    assert c.status == measure.OK, c.result.reason


@pytest.mark.parametrize("pattern", ["attention", "matmul"])
def test_on_one_device_ring_attentions_are_pruned_and_fused_gemms_offered(monkeypatch, pattern):
  """On one device a ring attention's compute is a local attention's: offered pruned (``ONE_DEVICE_RING``), never
  compiled; a fused GEMM, whose tiles are its own, is offered to compile. (CPU devices run no fused kernel: the
  lowering is stubbed, the offer is what is checked.)"""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  if pattern == "attention":
    prog, names = jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True), ["fused_ring_attention_ws"]
  else:
    prog, names = jm.programs.matmul(64, 128, 256), ["fused_allgather_matmul_ws", "fused_matmul_reducescatter"]
  assert [propose.one_device_ring(n) for n in names] == [pattern == "attention"] * len(names)
  def offered(cands):  # to compile: not pruned
    return sum(c.result is None for c in cands)
  without = propose.default_candidates(prog, mesh)
  monkeypatch.setattr(propose, "_fused_lowerings", lambda s, ins, out: names)
  monkeypatch.setattr(jm.Schedule, "lower_with", lambda self, name, **params: self)
  monkeypatch.setattr(propose.placements, "signature", id)
  cands = propose.default_candidates(prog, mesh)
  ring = [c for c in cands if c.result is not None and c.result.reason.startswith(propose.ONE_DEVICE_RING)]
  assert len(cands) > len(without)
  if pattern == "attention":
    assert offered(cands) == offered(without) and ring and all(c.status == measure.PRUNED for c in ring)
  else:
    assert offered(cands) > offered(without) and not ring


def test_on_one_device_fused_gemms_that_are_one_program_there_compile_once(monkeypatch):
  """On one device a GEMM + reduce-scatter kernel and the all-gather kernel with communication CTAs run what the
  all-gather kernel runs (``FusedKernel.one_device``): a training tune prunes them as the same program and compiles
  the training steps of three programs, no forwards first (Mosaic GPU kernels in interpret mode)."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  prog = jm.programs.matmul(128, 128, 128, dtype="bfloat16")
  compiled = []
  real = measure.compile_ahead
  monkeypatch.setattr(measure, "compile_ahead", lambda s, training: compiled.append(
      (getattr(s, "lowering", None), training)) or real(s, training=training))
  with registry.interpret_mode():
    result = _tune(prog, mesh, training=True, margin=100.0, top_k=8, space=0)
  same = "same program as allgather_matmul {fused_allgather_matmul}"
  twins = {c.lowering for c in result.candidates if c.result.reason == same}
  assert twins == {"fused_allgather_matmul", "fused_allgather_matmul_comm", "fused_matmul_reducescatter"}
  assert sorted(compiled, key=lambda c: c[0] or "") == [(None, True), (None, True), ("fused_allgather_matmul", True)]
  assert result.compiled == 3 and result.best is not None
