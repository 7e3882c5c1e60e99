"""``python -m jaxmercury.tune`` end to end on the simulated CPU mesh."""

import json
import os
import subprocess
import sys

import jax
import pytest
from conftest import assert_matches, make_mesh

import jaxmercury as jm
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
  assert "for training (forward and backward)" in out and report["objective"] == "training"
  _check_report(report, jm.programs.matmul(64, 32, 48))
  _run(MATMUL + ["--json", str(tmp_path / "f.json")], tmp_path)
  forward = json.loads((tmp_path / "f.json").read_text())
  assert forward["objective"] == "forward" and forward["from_database"] is False  # its own record


@pytest.mark.parametrize("args,message", [
    (["conv"], "usage"),
    (["matmul", "--mesh", "gpu=16"], "needs 16 devices"),
    (["matmul", "--memory_budget", "lots"], "expected a number and a unit"),
])
def test_cli_rejects_bad_arguments(tmp_path, args, message):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run([sys.executable, "-m", "jaxmercury.tune", *args, "--db", str(tmp_path / "t.db")],
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode != 0
  assert message in proc.stdout + proc.stderr
