"""``python -m jaxmercury.tune`` end to end on the simulated CPU mesh."""

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


def _run(args, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run([sys.executable, "-m", "jaxmercury.tune", *args, *COMMON, "--db", str(tmp_path / "t.db")],
                        capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def _check_report(report, prog):
  mesh = make_mesh("8")
  assert report["platform"] == "cpu" and report["mesh"] == {"gpu": 8}
  assert {c["status"] for c in report["candidates"]} <= {"ok", "pruned", "failed"}
  ok = [c for c in report["candidates"] if c["status"] == "ok"]
  assert ok and report["winner"]["name"] in {c["name"] for c in ok}
  assert report["baseline"]["name"] in {c["name"] for c in ok if c["plain"]}
  for c in ok[:3]:
    mesh_levels = jax.make_mesh((8,), ("gpu",), axis_types=mesh.axis_types)
    assert_matches(runnable_from_json(prog, mesh_levels, json.dumps(c["schedule"])))
  for c in report["candidates"]:
    if c["status"] != "ok":
      assert c["reason"]


def test_attention_cli_tunes_stores_and_reuses(tmp_path):
  out = _run(ATTENTION + ["--json", str(tmp_path / "a.json")], tmp_path)
  assert "simulated CPU mesh" in out and "winner:" in out and ("loop nest:" in out or "partitioned by XLA" in out)
  report = json.loads((tmp_path / "a.json").read_text())
  assert report["from_database"] is False
  _check_report(report, jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True))
  again = _run(ATTENTION + ["--json", str(tmp_path / "b.json")], tmp_path)
  second = json.loads((tmp_path / "b.json").read_text())
  assert second["from_database"] is True and "from the database" in again
  assert second["winner"]["schedule"] == report["winner"]["schedule"]
  assert "calibrating" not in again


def test_matmul_cli_with_budget_and_predictions(tmp_path):
  out = _run(MATMUL + ["--memory_budget", "1MiB", "--predict_mesh", "node=4,gpu=4", "--link_gbps", "node=100",
                       "--json", str(tmp_path / "m.json")], tmp_path)
  report = json.loads((tmp_path / "m.json").read_text())
  _check_report(report, jm.programs.matmul(64, 32, 48))
  assert report["winner"]["memory_bytes"] <= 2**20
  preds = report["predictions"]["candidates"]
  assert preds and all(p["predicted_ms"] > 0 for p in preds)
  assert "predicted on mesh {'node': 4, 'gpu': 4}" in out


def test_cli_tunes_a_training_step_apart_from_the_forward(tmp_path):
  out = _run(MATMUL + ["--training", "--json", str(tmp_path / "t.json")], tmp_path)
  report = json.loads((tmp_path / "t.json").read_text())
  assert "(training step) on mesh" in out and report["objective"] == "training"
  _check_report(report, jm.programs.matmul(64, 32, 48))
  _run(MATMUL + ["--json", str(tmp_path / "f.json")], tmp_path)
  forward = json.loads((tmp_path / "f.json").read_text())
  assert forward["objective"] == "forward" and forward["from_database"] is False  # its own record


def _proc(args, tmp_path, timeout=300):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  return subprocess.run([sys.executable, "-m", "jaxmercury.tune", *args, "--db", str(tmp_path / "t.db")],
                        capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["conv"], "error: unknown operator 'conv'; the operators are attention, matmul"),
    (["matmul", "extra"], "unexpected arguments ['extra']"),
    (["matmul", "--mesh", "gpu=16"], "needs 16 devices"),
    (["matmul", "--mesh", "gpu=0"], "--mesh 'gpu=0': level 'gpu' has size 0; each level needs at least 1 device"),
    (["matmul", "--mesh", "gpu"], "expected level=size pairs"),
    (["matmul", "--memory_budget", "lots"], "expected a number and a unit"),
    (["attention", "--kv_heads", "0"], "--kv_heads 0: must be at least 1"),
    (["attention", "--seq_len", "-256"], "--seq_len -256: must be at least 1"),
    (["attention", "--heads", "8", "--kv_heads", "3"], "--heads 8 is not a multiple of --kv_heads 3"),
    (["matmul", "--m", "0"], "--m 0: must be at least 1"),
    (["matmul", "--time_limit", "0"], "--time_limit 0: must be a positive number"),
    (["matmul", "--nosuchflag"], "Unknown command line flag 'nosuchflag'"),
])
def test_cli_rejects_bad_arguments_in_one_line_before_any_work(tmp_path, args, message):
  proc = _proc(args, tmp_path)
  assert proc.returncode == 2, proc.stderr
  assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
  assert "Traceback" not in proc.stderr and not (tmp_path / "t.db").exists()


def _flag_names() -> set[str]:
  return {name for name in tune.FLAGS if name not in ("help", "helpfull", "helpshort", "helpxml", "?", "flagfile",
                                                      "undefok")}


def test_cli_help_lists_every_flag_and_no_arguments_print_the_usage(tmp_path):
  for flag in ("--help", "-h", "--helpfull"):
    proc = _proc([flag], tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m jaxmercury.tune"), proc.stderr
    missing = [n for n in _flag_names() if f"--{n}:" not in proc.stdout and f"--[no]{n}:" not in proc.stdout]
    assert not missing, proc.stdout
  proc = _proc([], tmp_path)
  assert proc.returncode == 2 and proc.stderr.startswith("usage:") and "--help" in proc.stderr


def test_nothing_passed_says_why(tmp_path):
  proc = _proc(MATMUL + COMMON + ["--memory_budget", "1KiB"], tmp_path, timeout=600)
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("nothing passed of ") and "over the memory budget; raise --memory_budget" in last, last
  assert "numerical check" not in last


def test_a_mesh_that_divides_no_axis_pads_and_passes(tmp_path):
  out = _run(MATMUL + ["--mesh", "gpu=3", "--m", "100", "--json", str(tmp_path / "p.json")], tmp_path)
  report = json.loads((tmp_path / "p.json").read_text())
  failed = [c for c in report["candidates"] if c["status"] == "failed"]
  assert not failed, failed
  assert report["mesh"] == {"gpu": 3} and "== done in" in out and "\n== matmul(" in "\n" + out.split("\n", 1)[1]


def test_ctrl_c_keeps_the_measurements_and_the_same_command_resumes(tmp_path):
  """Ctrl-C after the first measurement (many candidates left, so that the tune is still running when the signal
  lands on a busy machine): exit 130, the count kept named; the same command resumes exactly those. The tune
  runs as ``-m`` runs it, its Ctrl-C handler installed first: a suite started in the background (``&`` without
  job control) ignores SIGINT, and Python installs that handler only where SIGINT is not ignored."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  many = ["--top", "16", "--space", "16", "--iters", "20"]
  as_m = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "runpy.run_module('jaxmercury.tune', run_name='__main__', alter_sys=True)")
  args = [sys.executable, "-u", "-c", as_m, *MATMUL, *many, "--db", str(tmp_path / "t.db")]
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
  env_args = [*MATMUL, *many, "--db", str(tmp_path / "t.db")]
  again = subprocess.run([sys.executable, "-m", "jaxmercury.tune", *env_args], capture_output=True, text=True,
                         env=env, timeout=600)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  assert again.stdout.count("(resumed)") == int(kept.group(1)) and "winner:" in again.stdout


def test_cpu_flags_run_interpreted_kernels_one_at_a_time():
  """The simulated CPU platform's XLA flags: the device count replaced, XLA's concurrency-optimized scheduler off
  once (interpret-mode kernels side by side hang two-core machines), a caller's explicit choice kept."""
  flags = cpu_flags("--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/d", 8)
  assert flags.split() == ["--xla_dump_to=/tmp/d", "--xla_force_host_platform_device_count=8", SEQUENTIAL_KERNELS]
  assert cpu_flags(flags) == flags
  kept = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
  assert cpu_flags(kept) == kept
