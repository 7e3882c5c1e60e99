"""``python -m jaxmercury.tune`` on the simulated CPU mesh: in this process through ``main(argv)``, and once as a
process of its own for the exit statuses and Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import sys

import jax
import pytest
from conftest import assert_matches, make_mesh

import jaxmercury as jm
from jaxmercury import tune
from jaxmercury._cpu_flags import SEQUENTIAL_KERNELS, cpu_flags
from jaxmercury.tuner.plain import runnable_from_json

ATTENTION = ["attention", "--batch", "1", "--heads", "4", "--kv_heads", "2", "--seq_len", "64",
             "--head_dim", "16", "--causal"]
MATMUL = ["matmul", "--m", "64", "--n", "32", "--k", "48"]
COMMON = ["--top", "2", "--space", "4", "--iters", "2"]
# Cost-model figures stored ahead in a test's database, so that only the README's job calibrates.
ASSUMED = jm.tuner.Machine("assumed", flops_per_s=5e9, link_bytes_per_s={"*": 3e8})


def _db(tmp_path, *programs, mesh=None):
  """A database holding assumed cost-model figures for ``programs`` on ``mesh`` (the CLI's default mesh)."""
  db = jm.Database(tmp_path / "t.db")
  for prog in programs:
    db.store_machine(prog, mesh or jax.make_mesh((8,), ("gpu",), axis_types=make_mesh("8").axis_types), ASSUMED)
  db.close()
  return str(tmp_path / "t.db")


def _tune(capsys, args, db, status=0):
  """``python -m jaxmercury.tune ARGS --db DB`` in this process: its standard output."""
  code = tune.main(["tune", *args, "--db", db])
  out = capsys.readouterr().out
  assert code == status, out[-3000:]
  return out


def _check_report(report, prog, mesh_shape=None):
  assert report["platform"] == "cpu" and report["mesh"] == (mesh_shape or {"gpu": 8})
  assert {c["status"] for c in report["candidates"]} <= {"ok", "pruned", "failed"}
  ok = [c for c in report["candidates"] if c["status"] == "ok"]
  assert ok and report["winner"]["name"] in {c["name"] for c in ok}
  assert report["baseline"]["name"] in {c["name"] for c in ok if c["plain"]}
  mesh = jax.make_mesh(tuple(report["mesh"].values()), tuple(report["mesh"]), axis_types=make_mesh("8").axis_types)
  for c in ok[:3]:
    assert_matches(runnable_from_json(prog, mesh, json.dumps(c["schedule"])))
  for c in report["candidates"]:
    if c["status"] != "ok":
      assert c["reason"]


def test_the_readme_job_calibrates_tunes_stores_and_reuses(tmp_path, capsys):
  db = str(tmp_path / "t.db")
  out = _tune(capsys, ATTENTION + COMMON + ["--json", str(tmp_path / "a.json")], db)
  assert "simulated CPU mesh" in out and "calibrating" in out and "winner:" in out
  assert "loop nest:" in out or "partitioned by XLA" in out
  report = json.loads((tmp_path / "a.json").read_text())
  assert report["from_database"] is False
  _check_report(report, jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True))
  again = _tune(capsys, ATTENTION + COMMON + ["--json", str(tmp_path / "b.json")], db)
  second = json.loads((tmp_path / "b.json").read_text())
  assert second["from_database"] is True and "from the database" in again
  assert second["winner"]["schedule"] == report["winner"]["schedule"]
  assert "calibrating" not in again


def test_matmul_with_budget_and_predictions_then_its_training_step_apart(tmp_path, capsys):
  prog = jm.programs.matmul(64, 32, 48)
  db = _db(tmp_path, prog)
  out = _tune(capsys, MATMUL + COMMON + ["--memory_budget", "1MiB", "--predict_mesh", "node=4,gpu=4", "--link_gbps",
                                         "node=100", "--json", str(tmp_path / "m.json")], db)
  report = json.loads((tmp_path / "m.json").read_text())
  assert report["objective"] == "forward"
  _check_report(report, prog)
  assert report["winner"]["memory_bytes"] <= 2**20
  preds = report["predictions"]["candidates"]
  assert preds and all(p["predicted_ms"] > 0 for p in preds)
  assert "predicted on mesh {'node': 4, 'gpu': 4}" in out
  out = _tune(capsys, MATMUL + COMMON + ["--training", "--json", str(tmp_path / "t.json")], db)
  report = json.loads((tmp_path / "t.json").read_text())
  assert "(training step) on mesh" in out and report["objective"] == "training"
  assert report["from_database"] is False  # its own record, not the forward's
  _check_report(report, prog)


def test_moe_tunes_a_mixture_of_experts_layer(tmp_path, capsys):
  args = ["--tokens", "64", "--d_model", "16", "--d_ff", "32", "--experts", "8", "--top_k", "2",
          "--capacity_factor", "2"]
  prog = jm.programs.moe(64, 16, 32, 8, 2, capacity_factor=2.0)
  out = _tune(capsys, ["moe", *args, *COMMON, "--json", str(tmp_path / "e.json")], _db(tmp_path, prog))
  report = json.loads((tmp_path / "e.json").read_text())
  assert "\n== moe(" in out and "winner:" in out
  _check_report(report, prog)
  assert any(c["strategy"] == "expert_parallel" and c["status"] == "ok" for c in report["candidates"])


def test_a_mesh_that_divides_no_axis_pads_and_passes(tmp_path, capsys):
  prog = jm.programs.matmul(100, 32, 48)
  mesh = jax.make_mesh((3,), ("gpu",), axis_types=make_mesh("8").axis_types, devices=jax.devices()[:3])
  out = _tune(capsys, MATMUL + COMMON + ["--mesh", "gpu=3", "--m", "100", "--json", str(tmp_path / "p.json")],
              _db(tmp_path, prog, mesh=mesh))
  report = json.loads((tmp_path / "p.json").read_text())
  failed = [c for c in report["candidates"] if c["status"] == "failed"]
  assert not failed, failed
  _check_report(report, prog, {"gpu": 3})
  assert "== done in" in out and "\n== matmul(" in "\n" + out.split("\n", 1)[1]


def test_nothing_passed_says_why(tmp_path, capsys):
  out = _tune(capsys, MATMUL + COMMON + ["--memory_budget", "1KiB"], _db(tmp_path, jm.programs.matmul(64, 32, 48)),
              status=1)
  last = out.strip().splitlines()[-1]
  assert last.startswith("nothing passed of ") and "over the memory budget; raise --memory_budget" in last, last
  assert "numerical check" not in last


@pytest.mark.parametrize("args,message", [
    (["conv"], "error: unknown operator 'conv'; the operators are attention, matmul, moe, weighted_sum"),
    (["matmul", "extra"], "unexpected arguments ['extra']"),
    (["matmul", "--mesh", "gpu=16"], "--mesh 'gpu=16' needs 16 devices; this machine has 8"),
    (["matmul", "--mesh", "gpu=0"], "--mesh 'gpu=0': level 'gpu' has size 0; each level needs at least 1 device"),
    (["matmul", "--mesh", "gpu"], "expected level=size pairs"),
    (["matmul", "--predict_mesh", "gpu=2,gpu=2"], "--predict_mesh 'gpu=2,gpu=2': level 'gpu' is named twice"),
    (["matmul", "--memory_budget", "lots"], "--memory_budget 'lots': expected a number and a unit"),
    (["matmul", "--link_gbps", "node=fast"], "--link_gbps 'node=fast': expected level=Gb/s pairs"),
    (["attention", "--kv_heads", "0"], "--kv_heads 0: must be at least 1 (key/value heads"),
    (["attention", "--seq_len", "-256"], "--seq_len -256: must be at least 1 (query and key length)"),
    (["attention", "--seq_len", "1.5"], "--seq_len '1.5': expected an integer (query and key length)"),
    (["attention", "--heads", "8", "--kv_heads", "3"], "heads (8) must be a positive multiple of kv_heads (3)"),
    (["attention", "--causal=maybe"], "--causal 'maybe': expected true or false"),
    (["attention", "--dtype", "float64"], "--dtype float64: must be one of float32, bfloat16, float16"),
    (["moe", "--top_k", "9"], "top_k=9 must be between 1 and experts=8"),
    (["moe", "--capacity_factor", "0"], "capacity_factor=0.0 must be a positive number"),
    (["matmul", "--m", "0"], "--m 0: must be at least 1"),
    (["matmul", "--m"], "--m needs a value (rows of A and C)"),
    (["matmul", "--time_limit", "0"], "--time_limit 0: must be a positive number"),
    (["matmul", "--isolation", "fork"], "--isolation fork: must be one of thread, process"),
    (["matmul", "--heads", "4"], "unknown flag --heads for matmul: it is a flag of attention"),
    (["matmul", "--nocausal"], "unknown flag --nocausal for matmul: it is a flag of attention"),
    (["matmul", "--mm", "4"], "unknown flag --mm for matmul: did you mean --m?"),
])
def test_bad_arguments_get_one_line_before_any_work(tmp_path, capsys, args, message):
  assert tune.run(["tune", *args, "--db", str(tmp_path / "t.db")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
  assert not (tmp_path / "t.db").exists()


def _documented(text: str) -> set[str]:
  return set(re.findall(r"--(?:\[no\])?([a-z_]+)", text))


def test_help_lists_every_operators_flags_and_no_arguments_print_the_usage(capsys):
  for flag in ("--help", "-h", "--helpfull"):
    assert tune.main(["tune", flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m jaxmercury.tune OPERATOR [flags]")
    for op in jm.programs.operators():
      assert f"\n{op.name}: {op.summary}\n" in out
    assert _documented(out) >= {p.name for op in jm.programs.operators() for p in op.params + tune.TUNING}
  assert tune.main(["tune", "moe", "--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: python -m jaxmercury.tune moe [flags]") and "--capacity_factor NUMBER" in out
  assert "--seq_len" not in out and "--mesh TEXT" in out
  assert tune.main(["tune"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("usage:") and "--help" in err


def test_a_registered_operator_gets_its_flags_help_and_checks(monkeypatch, capsys):
  """An operator registered by a user (a program of their own) is tuned by name like the shipped ones."""
  from jaxmercury.programs import registry
  built = []

  def scaled_sum(*, rows, cols, dtype):
    built.append((rows, cols, dtype))
    return jm.programs.weighted_sum(rows, cols, dtype=dtype)
  op = jm.programs.Operator(name="scaled_sum", summary="a user's operator", build=scaled_sum, params=(
      jm.programs.Param(name="rows", default=16, minimum=1, help="rows"),
      jm.programs.Param(name="cols", default=8, minimum=2, help="columns"), jm.programs.DTYPE))
  monkeypatch.setitem(registry._OPERATORS, "scaled_sum", op)
  with pytest.raises(jm.ProgramError, match="registered already"):
    jm.programs.register_operator(jm.programs.Operator(name="scaled_sum", summary="", params=(), build=scaled_sum))
  assert tune.main(["tune", "--help"]) == 0
  assert "scaled_sum: a user's operator\n  --rows INT" in capsys.readouterr().out
  assert tune.run(["tune", "scaled_sum", "--cols", "1"]) == 2
  assert "--cols 1: must be at least 2 (columns)" in capsys.readouterr().err
  assert tune.parse_args(["scaled_sum", "--rows=4"])[:2] == (op, {"rows": 4, "cols": 8, "dtype": "float32"})
  assert op.program(rows=4).params == {"i": 4, "j": 8, "dtype": "float32"} and built == [(4, 8, "float32")]


def test_exit_statuses_and_ctrl_c_as_a_process(tmp_path, capsys):
  """As a process: a bad argument is one line on stderr and exit status 2; Ctrl-C after the first measurement (many
  candidates left, so that the tune is still running when the signal lands on a busy machine) exits 130 naming the
  count kept, and the same command resumes exactly those. The tune runs as ``-m`` runs it, its Ctrl-C handler
  installed first: a suite started in the background (``&`` without job control) ignores SIGINT, and Python
  installs that handler only where SIGINT is not ignored."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  bad = subprocess.run([sys.executable, "-m", "jaxmercury.tune", "matmul", "--m", "0"], capture_output=True,
                       text=True, env=env, timeout=300)
  assert bad.returncode == 2 and bad.stderr == "error: --m 0: must be at least 1 (rows of A and C)\n", bad.stderr
  db = _db(tmp_path, jm.programs.matmul(64, 32, 48))
  many = ["--top", "16", "--space", "16", "--iters", "20"]
  as_m = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "runpy.run_module('jaxmercury.tune', run_name='__main__', alter_sys=True)")
  args = [sys.executable, "-u", "-c", as_m, *MATMUL, *many, "--db", db]
  proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "[1/" in line:
      proc.send_signal(signal.SIGINT)
      break
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, "".join(seen) + out + err
  kept = re.fullmatch(r"interrupted; (\d+) measurements kept, rerun to resume", err.strip().splitlines()[-1])
  assert kept and int(kept.group(1)) >= 1, err
  assert "Traceback" not in err and "terminate called" not in err
  again = _tune(capsys, [*MATMUL, *many], db)
  assert again.count("(resumed)") == int(kept.group(1)) and "winner:" in again


def test_cpu_flags_run_interpreted_kernels_one_at_a_time():
  """The simulated CPU platform's XLA flags: the device count replaced, XLA's concurrency-optimized scheduler off
  once (interpret-mode kernels side by side hang two-core machines), a caller's explicit choice kept."""
  flags = cpu_flags("--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/d", 8)
  assert flags.split() == ["--xla_dump_to=/tmp/d", "--xla_force_host_platform_device_count=8", SEQUENTIAL_KERNELS]
  assert cpu_flags(flags) == flags
  kept = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
  assert cpu_flags(kept) == kept
