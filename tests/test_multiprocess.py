"""Agreement across processes: 2 CPU processes x 4 devices under jax.distributed (gloo) tune as one.

Each process has its own database holding a different winner; process 0
decides, the other is overruled, both use process 0's schedule and get the
reference's result on the shards they hold. A second, real tuning run makes
the decisions of one process: it calibrates (process 0's figures, measured
with the other's help where they run over the mesh, are broadcast and stored
by both), the plain program is a candidate, the
candidates compile at once on threads, each is timed on both processes with
the times combined (the slowest counts), and the final round runs in
lockstep, so that both processes see the same times and pick the same
winner, never one measured slower than the plain program.
"""

import textwrap

import numpy as np
import pytest
from conftest import fresh_key, make_mesh, run_processes

import jaxmercury as jm
from jaxmercury.tuner import measure

PROCESS = textwrap.dedent("""
    import json, os, sys
    pid, port, db_path, stored = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jaxmercury as jm
    from jaxmercury.tuner import cost, decide, measure
    from jaxmercury.tuner.autotuner import Candidate

    decide.FINAL_MARGIN = 1e9  # every timed candidate is a finalist: a final round is held

    machine = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    prog = jm.programs.matmul(64, 128, 256)
    lib = jm.library(prog, mesh)
    db = jm.Database(db_path)
    mine = Candidate(stored, lib[stored], 0.5, 1024, measure.Measurement("ok", 1.0 + pid, [1.0 + pid], 1e-7))
    db.store(prog, mesh, mine, [mine])  # the two databases disagree
    lines = []

    def log(line):
      lines.append(line)
      print(f"[{pid}] {line}", flush=True)

    def check(schedule):
      xs = prog.random_inputs(jax.random.key(7))  # the same values on every process
      ref = np.asarray(prog.reference(*xs))
      y = schedule.compile()(*[jax.device_put(np.asarray(x), NamedSharding(mesh, P())) for x in xs])
      return (max(float(np.max(np.abs(np.asarray(s.data) - ref[s.index]))) for s in y.addressable_shards),
              float(np.max(np.abs(ref))), len(y.addressable_shards))

    first = jm.autotune(prog, mesh, database=db, machine=machine, log=log)
    err1, scale, shards = check(first.best.schedule)
    second = jm.autotune(prog, mesh, space=2, top_k=3, margin=1e9, iters=4, database=db, retune=True,
                         compile_threads=2, log=log)  # calibrated: process 0's figures, broadcast
    err2, _, _ = check(second.best.schedule)
    plain = second.baseline
    report = {
        "process": jax.process_index(), "devices": len(jax.devices()), "local": len(jax.local_devices()),
        "first": {"name": first.best.name, "trace": first.best.schedule.to_json(),
                  "from_database": first.from_database, "err": err1},
        "second": {"name": second.best.name, "trace": second.best.schedule.to_json(), "err": err2,
                   "from_database": second.from_database, "plain": plain and plain.name,
                   "best_plain": second.best.plain, "decision": second.decision,
                   "times": {c.name: c.time_ms for c in second.candidates},
                   "final": {c.name: c.final_ms for c in second.candidates if c.final_ms is not None},
                   "phases": second.phases, "machine": second.machine.to_dict(), "table": second.table(),
                   "not_offered": second.not_offered,
                   "stored_machine": jm.Database(db_path).machine(prog, mesh).to_dict()},
        "scale": scale, "shards": shards, "stored_after": jm.Database(db_path).lookup(prog, mesh).to_json(),
        "log": lines}
    print("REPORT " + json.dumps(report), flush=True)
    jax.distributed.shutdown()
""")


def test_two_processes_agree_on_process_zeros_schedule(tmp_path):
  stored = {0: "allgather_matmul", 1: "async_tp"}
  reports = run_processes(PROCESS, [[str(tmp_path / f"p{i}.db"), stored[i]] for i in (0, 1)], devices=4)
  assert [r["process"] for r in reports] == [0, 1]
  assert all(r["devices"] == 8 and r["local"] == 4 and r["shards"] == 4 for r in reports)

  # A stored winner: process 0's, on both; process 1's database is overruled and brought in line.
  lead, other = reports
  assert lead["first"]["name"] == other["first"]["name"] == "allgather_matmul"
  assert lead["first"]["trace"] == other["first"]["trace"] and other["first"]["from_database"]
  assert any("overruled by process 0's 'allgather_matmul'" in line for line in other["log"]), other["log"]
  assert not any("overruled" in line for line in lead["log"])

  # A real tuning run: the same winner and the same (combined) times on both processes, its own and the final
  # round's; the plain program among the timed, in the final round, never beaten by a schedule measured slower.
  second = lead["second"]
  assert not second["from_database"]
  assert second["trace"] == other["second"]["trace"] and second["decision"] == other["second"]["decision"]
  assert second["times"] == other["second"]["times"] and second["final"] == other["second"]["final"]
  timed = {n: t for n, t in second["times"].items() if t is not None}
  assert len(timed) >= 3 and all(t > 0 for t in timed.values())
  assert second["plain"] in timed and second["plain"] in second["final"] and len(second["final"]) >= 2
  assert "final round" in second["decision"] and "on the candidates' own times" not in second["decision"]
  if not second["best_plain"]:
    assert second["final"][second["name"]] < second["final"][second["plain"]], second["decision"]
  assert second["phases"]["compile"] > 0 and second["phases"]["final round"] > 0
  assert second["machine"] == other["second"]["machine"] == second["stored_machine"] == other["second"]["stored_machine"]
  assert any("calibrating the cost model" in line for line in lead["log"])
  # The fused GEMM kernels compute this operator but do not run here (float32, CPUs, two processes): the table
  # says why.
  assert second["not_offered"] and "not offered: " in second["table"]
  assert lead["stored_after"] == other["stored_after"] == second["trace"]

  # Each process's shards of the result equal the reference's.
  for r in reports:
    for run in ("first", "second"):
      assert r[run]["err"] <= 1e-4 * r["scale"], (r["process"], run, r[run]["err"])


def _two_processes(other):
  """A ``gather`` as if a second process reported ``other(row)`` for each row this one reports."""
  return lambda a: np.stack([np.asarray(a, np.float64), np.asarray(other(np.asarray(a, np.float64)), np.float64)])


def test_measurements_combine_across_processes_slowest_counts():
  prog, mesh = jm.programs.matmul(64, 128, 256), make_mesh("8")
  s = jm.library(prog, mesh)["allgather_matmul"]
  xs = prog.random_inputs(fresh_key())
  ref = prog.reference(*xs)
  iters = 5  # timing rows have 5 entries; the check row has 4 (code, finite, squared error, squared norm)
  alone = measure.measure(s, xs, ref, iters=iters)
  # the other process took 10 s per run, far longer than this one's: each run counts as long as it took there
  slower = measure.measure(s, xs, ref, iters=iters,
                           gather=_two_processes(lambda a: np.full(len(a), 1e4) if len(a) == iters else a))
  assert alone.status == slower.status == measure.OK and slower.rel_err == pytest.approx(alone.rel_err, abs=1e-9)
  assert alone.median_ms < 1e4 and slower.median_ms == 1e4 and slower.times_ms == [1e4] * iters
  failed = measure.measure(s, xs, ref, iters=iters,
                           gather=_two_processes(lambda a: [1.0, 1.0, 0.0, 0.0] if len(a) == 4 else a))
  assert failed.status == measure.FAILED and failed.reason == "compile or run error on process 1"
  nan = measure.measure(s, xs, ref, iters=iters,
                        gather=_two_processes(lambda a: [0.0, 0.0, 0.0, a[3]] if len(a) == 4 else a))
  assert nan.status == measure.FAILED and nan.reason == "output has NaN or Inf"
  wrong = measure.measure(s, xs, ref, iters=iters,
                          gather=_two_processes(lambda a: [0.0, 1.0, 1e-2 * a[3], a[3]] if len(a) == 4 else a))
  assert wrong.status == measure.FAILED and wrong.reason.startswith("wrong result")
  assert wrong.rel_err == pytest.approx(np.sqrt(0.5e-2), rel=1e-3)
