"""Every benchmark suite (``python -m benchmarks.run``) at ``--smoke`` on the simulated 8-device CPU mesh.

Each runs in a subprocess, as a user runs it, on fresh random inputs (a new seed every run). The checks: every
contestant ran or was skipped with its reason, and every one that ran agrees with the program's own reference on
one device; the ratios, floors and results-file fields are what the records say.
"""

import collections
import json
import os
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_matches

import jaxmercury as jm
from benchmarks import cases, clocks, harness, kernel_trace, operators, packed, run, ws_local
from jaxmercury.kernels import registry
from jaxmercury.tuner import measure
from jaxmercury.tuner.autotuner import lowering_variants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = {"schema", "suite", "date", "device", "platform", "n_devices", "jax_version", "jaxlib_version",
          "jaxmercury_version", "python", "commit", "command", "smoke", "seed", "settings", "links", "machines",
          "cases", "wall_s"}


def _run(*args, timeout=600):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
  return subprocess.run([sys.executable, "-m", "benchmarks.run", *args], capture_output=True, text=True, cwd=ROOT,
                        env=env, timeout=timeout)


def _smoke(tmp_path, suite, *extra):
  out = tmp_path / f"{suite}.json"
  proc = _run("--suite", suite, "--smoke", "--out", str(out), *extra)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  results = json.loads(out.read_text())
  assert set(results) >= HEADER, sorted(HEADER - set(results))
  assert results["schema"] == harness.SCHEMA and results["suite"] == suite and results["smoke"] is True
  assert results["platform"] == "cpu" and results["n_devices"] == 8 and isinstance(results["seed"], int)
  assert results["command"] == "python -m benchmarks.run " + " ".join(["--suite", suite, "--smoke", "--out", str(out),
                                                                        *extra])
  assert results["commit"] is None or len(results["commit"].split("-")[0]) == 40
  assert "unfinished" not in results
  for case in results["cases"]:
    assert case["name"] in proc.stdout  # the run printed its tables
  return results


def _by_name(case):
  return {r["name"]: r for r in case["contestants"]}


def _check(case, timed, skipped=(), tolerance=harness.BF16_TOLERANCE, reference="program_reference"):
  """The case ran, its ``timed`` contestants agree with the reference and were timed, the rest were skipped (with
  these words in the reason), and the ranks are what the medians say."""
  assert case["status"] == "ok" and case["agree"] is True, case
  recs = _by_name(case)
  ref = recs[case["reference"]]
  assert case["reference"] == reference and ref["role"] == "reference" and ref["rel_err"] == 0.0
  assert ref["numerics_ok"] is True and "median_ms" not in ref  # checked against, not timed
  assert set(recs) == {reference, *timed, *dict(skipped)}, sorted(recs)
  for name in timed:
    r = recs[name]
    assert "error" not in r and "skipped" not in r, r
    assert r["numerics_ok"] is True and 0 <= r["rel_err"] < tolerance, r
    assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] and len(r["times_ms"]) >= 3, r
    assert r["ratio_to_best_baseline"] == pytest.approx(case["best_baseline_ms"] / r["median_ms"])
  for name, words in dict(skipped).items():
    assert words in recs[name]["skipped"], recs[name]
  baselines = [recs[n] for n in timed if recs[n]["role"] == "baseline"]
  assert case["best_baseline_ms"] == min(r["median_ms"] for r in baselines)
  assert recs[case["best_baseline"]]["role"] == "baseline"
  return recs


def _floor(case, recs):
  floor = case["floor"]
  assert floor["compute_ms"] > 0 and floor["comm_ms"] > 0 and floor["comm_bytes_per_device"] > 0
  assert floor["floor_ms"] == max(floor["compute_ms"], floor["comm_ms"])
  for r in recs.values():
    if "median_ms" in r:
      assert r["floor_fraction"] == pytest.approx(floor["floor_ms"] / r["median_ms"])


def test_attention_suite(tmp_path):
  """Tuned jaxmercury against every attention baseline on a two-level mesh (USP runs there); the tuner's plot is
  drawn."""
  plots = tmp_path / "plots"
  results = _smoke(tmp_path, "attention", "--plots", str(plots))
  (case,) = results["cases"]
  assert case["name"] == "attention GQA B2 S128 H8 KV2 D16 causal mesh 2x4"
  recs = _check(case, ["cp_allgather", "ring", "ulysses", "usp", "jaxmercury"])
  _floor(case, recs)
  assert case["mesh"] == {"node": 2, "gpu": 4} and set(results["links"]) == {"2x4"}
  tuner = case["tuner"]
  assert tuner["winner"] and tuner["candidates"] and {c["status"] for c in tuner["candidates"]} <= {"ok", "pruned"}
  assert recs["jaxmercury"]["strategy"] and "kernel" in recs["jaxmercury"] and "lowering_config" in recs["jaxmercury"]
  assert os.path.getsize(tuner["plot"]) > 10_000 and os.path.dirname(tuner["plot"]) == str(plots)


def test_the_sweep_replays_its_winner_above_the_tuning_limit(tmp_path):
  """Above --tune_max_tflop a case is not tuned: the sweep's last winner, tuned at a smaller size, runs at this
  one (and agrees with the program's reference); below it, or with no winner yet, the case is tuned."""
  args = run.parse_args(["--suite", "attention", "--smoke", "--tune_max_tflop", "1e-9", "--out",
                         str(tmp_path / "a.json")])
  env = operators.Env(args, {"machines": {}}, deadline=time.time() + 600)
  small, big = cases.AttentionCase(1, 4, 2, 16, 32, True, "8"), cases.AttentionCase(1, 4, 2, 16, 64, True, "8")
  assert small.family == big.family
  mesh = env.mesh(big.mesh)
  ring = jm.library(operators.program(small), mesh)["ring"]
  env.winners[small.family] = (small.flops, ring.to_json(), {"strategy": "ring", "origin": "library"})
  prog = operators.program(big)
  ins, out = operators.layouts(big, mesh)
  rec = {}
  contestant = operators.tuned(env, big, prog, mesh, ins, out, rec)
  assert "above --tune_max_tflop 1e-09" in rec["tuner"]["not_tuned"] and "replayed" in rec["tuner"]
  assert "winner" not in rec["tuner"] and contestant.record["strategy"] == "ring"
  assert_matches(types.SimpleNamespace(program=prog, compile=contestant.build))  # it runs, and agrees


def test_gemm_suite_and_its_windowed_einsum_child(tmp_path):
  """Tuned jaxmercury against the GEMM baselines; XLA's windowed einsum ran in a child process under its flags,
  on the same inputs, agreeing with the reference there."""
  from benchmarks.baselines import WINDOWED_EINSUM_FLAGS
  results = _smoke(tmp_path, "gemm")
  hopper = {f"pallas_mgpu[{'/'.join(map(str, c))}]": "Hopper" for c in
            ((128, 128, "N", 8, "N"), (128, 128, "M", 8, "M"), (256, 64, "N", 8, "N"), (128, 128, "N", 16, "M"))}
  (ag,) = results["cases"]
  _floor(ag, _check(ag, ["allgather_dot", "xla_auto", "jaxmercury", "xla_auto_windowed"], hopper))
  child = json.loads((tmp_path / "gemm.windowed.json").read_text())
  assert "--windowed_child" in child["command"] and child["seed"] == results["seed"]
  assert results["windowed"]["status"] == "exit 0"
  windowed = _by_name(ag)["xla_auto_windowed"]
  assert windowed["process"] == "separate" and windowed["xla_flags"] == WINDOWED_EINSUM_FLAGS
  there = _by_name(next(c for c in child["cases"] if c["name"] == ag["name"]))
  assert there["xla_auto_windowed"]["median_ms"] == windowed["median_ms"]
  assert there["program_reference"]["role"] == "reference"  # checked against the program there too


def test_fused_suite(tmp_path):
  """The library schedules the fused kernels lower run and agree; every fused kernel of their placement kind is a
  contestant, skipped on the CPU with the kernel's own reason; ``--trace_rounds``: each timed one traced after (on
  the CPU wall times only, no GPU lines)."""
  results = _smoke(tmp_path, "fused", "--trace_rounds", "1")
  attention, rs = results["cases"]
  assert results["settings"]["trace_rounds"] == 1
  for case in results["cases"]:
    timed = [r for r in case["contestants"] if "median_ms" in r]
    assert timed and all(r["trace"]["calls"] == 1 and r["trace"]["wall_ms"] > 0 for r in timed)
    assert all("span_ms" not in r["trace"] for r in timed)
  recs = _check(attention, ["cp_allgather", "ring", "ring_zigzag"],
                {"ulysses": "do not split", "usp": "two-level", "ring {fused_ring_attention}": "block_q",
                 "ring {fused_ring_attention_ws}": "block_q", "ring_zigzag {fused_ring_attention}": "zigzag chunk",
                 "ring_zigzag {fused_ring_attention_ws}": "zigzag chunk"})
  assert recs["ring {fused_ring_attention}"]["lowering"] == "fused_ring_attention"
  assert recs["ring"]["strategy"] == "ring" and recs["ring"]["lowering"] is None
  fused_rs = [n for n in _by_name(rs) if n.startswith("async_tp_reducescatter {")]
  _check(rs, ["dot_psum_scatter", "xla_auto", "async_tp_reducescatter"], {n: "Hopper" for n in fused_rs})
  assert len(fused_rs) == 2


def test_fused_suite_offers_every_all_gather_kernel():
  """The all-gather GEMM's fused kernels are the fused suite's contestants beside the library schedule they lower,
  each skipped on the CPU with the kernel's own reason (built, not run)."""
  args = run.parse_args(["--suite", "fused", "--smoke"])
  env = operators.Env(args, {}, deadline=time.time() + 60)
  case = cases.GemmCase("allgather", 256, 256, 512, "8", "tiny.up")
  mesh = env.mesh(case.mesh)
  contestants = {c.name: c for c in operators.fused(env, case, operators.program(case), mesh,
                                                    *operators.layouts(case, mesh))}
  fused_ag = [n for n in contestants if n.startswith("async_tp {")]
  assert len(fused_ag) == 4 and all("Hopper" in contestants[n].skip for n in fused_ag), contestants
  assert set(contestants) == {"async_tp", *fused_ag} and contestants["async_tp"].skip is None


def test_fused_training_tries_every_backward():
  """The fused suite's contestants are the tuner's: in training each fused kernel at its defaults and at every other
  backward it offers (the warp-specialized ring attention with cuDNN's blocks and with ours, which interpret mode
  runs on a CPU device); a GEMM's has one backward, and the forward one configuration."""
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  assert lowering_variants("fused_ring_attention_ws", mesh, True) == [{}, {"backward": "ws_attention"}]
  assert lowering_variants("fused_ring_attention_ws", mesh, False) == [{}]
  assert lowering_variants("fused_allgather_matmul", mesh, True) == [{}]


def test_fused_params_add_variants_where_the_configuration_has_the_fields():
  """``--fused_params`` sets are data (JSON objects), each added to a fused kernel's variants where its configuration
  has every field: the warp-specialized ring attention in other blocks beside its default, at each backward."""
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  args = run.parse_args(["--suite", "fused", "--fused_params", '{"block_kv": 64}', '{"block_kv": 64, "x": 1}'])
  env = types.SimpleNamespace(args=args, training=True)
  assert operators.fused_variants(registry.fused("fused_ring_attention_ws"), mesh, env) == [
      {}, {"backward": "ws_attention"}, {"block_kv": 64}, {"backward": "ws_attention", "block_kv": 64}]
  assert operators.fused_variants(registry.fused("fused_allgather_matmul"), mesh, env) == [{}]
  for bad in ("[1]", "{}", "block_kv=64"):
    with pytest.raises(SystemExit):
      run.parse_args(["--suite", "fused", "--fused_params", bad])


def test_an_unknown_fused_kernel_is_refused_before_any_work(capsys, monkeypatch):
  for name in ("JAX_PLATFORMS", "XLA_FLAGS"):  # main sets them for --smoke: restored after the test
    monkeypatch.setenv(name, os.environ.get(name, ""))
  assert run.main(["--suite", "fused", "--smoke", "--fused_kernels", "fused_ring_attention_wx"]) == 2
  err = capsys.readouterr().err
  assert "--fused_kernels names no fused kernel ['fused_ring_attention_wx']" in err
  assert "fused_ring_attention_ws" in err  # the valid names


def test_training_suite(tmp_path):
  """Training steps (output and every input's gradient) of the baselines and of jaxmercury tuned for them agree."""
  results = _smoke(tmp_path, "training")
  (attention,) = results["cases"]
  assert attention["training"] and "floor" not in attention
  _check(attention, ["cp_allgather", "ring", "ulysses", "jaxmercury"], {"usp": "two-level"}, tolerance=3e-2)
  assert attention["tuner"]["winner"]


def test_kernels_suite(tmp_path):
  """Every local attention kernel that runs on the CPU (Pallas interpret mode) against XLA's attention: the training
  step's output and gradients, so forward and backward."""
  results = _smoke(tmp_path, "kernels", "--training")
  (case,) = results["cases"]
  assert case["training"] is True and case["config"]["mesh"] == "1"
  recs = {r["name"]: r for r in case["contestants"]}
  assert {"dot_product_attention", "xla", "pallas_attention"} <= set(recs) and case["reference"] == \
      "dot_product_attention"
  for r in recs.values():
    assert r["numerics_ok"] and r["rel_err"] < 3e-2 and r["median_ms"] > 0 and r["tflops_per_device"] > 0, r
  assert recs["pallas_attention"]["kernel"] == "pallas_attention"
  assert "default_kernel" in case


def test_tuner_suite(tmp_path):
  """The tuner's winner and every library strategy timed side by side; the cost model's rank correlation."""
  results = _smoke(tmp_path, "tuner")
  for case in results["cases"]:
    recs = {r["name"]: r for r in case["contestants"]}
    strategies = [r for r in recs.values() if r["role"] == "baseline"]
    _check(case, ["jaxmercury", *(r["name"] for r in strategies)])
    assert len(strategies) >= 4 and all(r["predicted_ms"] > 0 for r in strategies)
    assert case["tuner"]["winner"] and case["tuner"]["wall_s"] > 0
    assert case["ranked"] == len(strategies) + 1 and -1 <= case["spearman_predicted_vs_measured"] <= 1


def test_llama_suite(tmp_path):
  """The graph plans of a tiny block, both residual layouts and objectives, against XLA's shardings: forward and
  training step checked against the block on one device; each operator of the plan beside XLA's."""
  results = _smoke(tmp_path, "llama", "--split", "--iters", "2")
  forward, training, *operators = results["cases"]
  plans = ["jaxmercury_plan", "jaxmercury_plan_replicated", "jaxmercury_plan_training",
           "jaxmercury_plan_replicated_training"]
  for case in (forward, training):
    assert set(case["plans"]) == set(plans) and "operators:" in case["plans"]["jaxmercury_plan"]["plan"]
    timed = [p for p in plans if case["plans"][p]["same_as"] is None]
    _check(case, [*timed, "xla_megatron_tp", "xla_megatron_tp_sp", "xla_sequence_parallel"], tolerance=5e-2,
           reference="one_device")
  assert forward["group"] == "forward" and training["group"] == "training"
  assert "training step" in forward["plans"]["jaxmercury_plan_training"]["plan"]
  assert {c["operator"] for c in operators} >= {"wq", "attention", "w_down"}
  for case in operators:
    assert case["group"] in ("operators forward", "operators training")
    pair = _by_name(case)
    assert case["status"] == "ok" and case["reference"] == "xla" and pair["jaxmercury"]["numerics_ok"]
    assert pair["jaxmercury"]["rel_err"] < 5e-2 and pair["jaxmercury"]["median_ms"] > 0 and pair["xla"]["median_ms"] > 0


def test_llama_reprice_of_recorded_gpu_runs(tmp_path):
  """The plans two 2 x H200 runs timed (4K and 32K tokens), rebuilt from their recorded choices and calibrated
  figures and priced by the current cost model: every recorded choice is still offered, and every prediction,
  forward and training step, lies within 15% of the measured time."""
  files = [os.path.join(ROOT, f"tests/data/2026-11-24-s11-llama_block-{seq}-2xH200.json") for seq in (4096, 32768)]
  out = tmp_path / "predictions.json"
  assert run.main(["--suite", "llama", "--reprice", *files, "--out", str(out)]) == 0  # in this process: no JAX run
  data = json.loads(out.read_text())
  assert data["command"].startswith("python -m benchmarks.run --suite llama --reprice")
  assert {(r["seq"], r["plan"]) for r in data["rows"]} == {(s, p) for s in (4096, 32768) for p in (
      "jaxmercury_plan", "jaxmercury_plan_replicated", "jaxmercury_plan_training",
      "jaxmercury_plan_replicated_training")}
  for r in data["rows"]:
    for kind in ("forward", "training"):
      assert 0.85 < r[f"{kind}_predicted_ms"] / r[f"{kind}_measured_ms"] < 1.15, (r["seq"], r["plan"], kind)


@pytest.mark.parametrize("suite", ["fused", "gemm"])
def test_suites_say_they_need_gpus(tmp_path, capfd, suite):
  """Without --smoke on a CPU machine: one line saying so, exit status 2 (the gemm suite's child says it)."""
  assert run.main(["--suite", suite, "--out", str(tmp_path / "x.json")]) == 2
  out, err = capfd.readouterr()
  assert out == "" and err.strip().splitlines() == [
      f"benchmarks.run --suite {suite} times GPUs; this machine has only CPU devices: run it with --smoke for a "
      "check on a simulated CPU mesh"], out + err
  assert not (tmp_path / "x.json").exists()


def test_moe_suite(tmp_path):
  """The MoE layer (jaxmercury's dispatched schedules against the plain-JAX einsum dispatch, both checked against the
  dense reference); ragged_dot and the Mosaic grouped GEMM (skipped on CPUs, naming the device) against the padded
  grouped GEMM, forward + backward."""
  results = _smoke(tmp_path, "moe")
  layer, grouped = results["cases"]
  assert layer["config"]["kind"] == "layer" and layer["config"]["capacity_factor"] == 1.25
  assert (grouped["config"]["kind"], grouped["config"]["projection"], grouped["config"]["backward"]) == (
      "grouped_gemm", "down", True)
  recs = _by_name(layer)
  timed = [n for n in recs if n != "dense_reference"]
  assert {"einsum_dispatch", "expert_parallel[ragged_dot]", "expert_parallel[dense]"} <= set(timed)
  _check(layer, timed, reference="dense_reference")
  recs = _by_name(grouped)
  assert grouped["reference"] == "padded_einsum" and grouped["agree"] and recs["ragged_dot"]["median_ms"] > 0
  assert sum(grouped["group_sizes"]) == 512 and recs["ragged_dot"]["ratio_to_ragged_dot"] == 1.0
  assert "cpu" in recs["mosaic_grouped_gemm"]["skipped"] and recs["mosaic_grouped_gemm"]["gemm"] == \
      "mosaic_grouped_gemm"
  for case in results["cases"]:
    assert all(r["tflops_per_device"] > 0 for r in _by_name(case).values() if "median_ms" in r)


def test_ws_local_smoke(tmp_path):
  """The forward against XLA's attention, and the backward alone against XLA's derivative, in interpret mode:
  each timed and agreeing."""
  for mode in ([], ["--backward"]):
    out = tmp_path / "ws.json"
    ws_local.main(["--smoke", "--causal", "yes", *mode, "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["suite"] == "ws_local" and results["command"].startswith("python -m benchmarks.ws_local --smoke")
    (case,) = results["cases"]
    assert case["causal"] and case["agree"] and case["backward"] == bool(mode)
    assert [r["name"] for r in case["contestants"]] == ["cudnn", "ws"]
    assert all(r["median_ms"] > 0 and r["rel_err"] < 2e-2 for r in case["contestants"])


def test_ws_local_causal_training_smoke_finishes(tmp_path):
  """A causal training step on our kernels in interpret mode, in a fresh process as run from a shell: with XLA's
  concurrency-optimized scheduler on, a two-core machine hung here every time (``jaxmercury._cpu_flags``)."""
  out = tmp_path / "ws.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  subprocess.run([sys.executable, "-m", "benchmarks.ws_local", "--smoke", "--training", "--causal", "yes", "--out",
                  str(out)], cwd=ROOT, env=env, check=True, timeout=300, capture_output=True)
  (case,) = json.loads(out.read_text())["cases"]
  assert case["causal"] and case["training"] and case["agree"]
  assert [r["name"] for r in case["contestants"]] == ["cudnn", "ws", "ws_own"]
  assert all(r["median_ms"] > 0 and r["rel_err"] < 3e-2 for r in case["contestants"])


def test_negative_trace_rounds_refused(capsys):
  """``--trace_rounds -1``: a usage error naming the flag, before any work."""
  for main in (run.main, ws_local.main):
    with pytest.raises(SystemExit) as exit_:
      main(["--suite", "fused", "--trace_rounds", "-1"] if main is run.main else ["--out", "x", "--trace_rounds", "-1"])
    assert exit_.value.code == 2 and "--trace_rounds: -1 is negative (expected 0 or more)" in capsys.readouterr().err


def test_ws_local_training_steps_choose_the_contestants(tmp_path, monkeypatch):
  """``--training_steps ws_own``: cuDNN's step and ours only, the others neither built nor timed (each contestant
  here XLA's attention, so that the test times no kernel)."""
  built = []

  def xla_step(name, mesh, b, s, h, kv, d, causal, smoke):
    built.append(name)
    return measure.training_step(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal))
  monkeypatch.setattr(ws_local, "training_step", xla_step)
  out = tmp_path / "ws.json"
  ws_local.main(["--smoke", "--training", "--causal", "no", "--training_steps", "ws_own", "--out", str(out)])
  (case,) = json.loads(out.read_text())["cases"]
  assert [r["name"] for r in case["contestants"]] == ["cudnn", "ws_own"] and built == ["cudnn", "ws_own"]
  assert case["agree"] and all(r["median_ms"] > 0 for r in case["contestants"])
  with pytest.raises(SystemExit):
    ws_local.main(["--smoke", "--training", "--training_steps", "cudnn", "--out", str(out)])


def test_sustained_blocks_time_back_to_back_runs():
  """``Settings.sustain_s``: each contestant's ``iters`` timed runs are blocks of back-to-back runs (after an untimed
  half block), each recorded as its mean per run; a call that takes longer takes longer per block."""
  calls = collections.Counter()

  def sleeper(name, ms):
    def call(x):
      calls[name] += 1
      time.sleep(ms / 1e3)
      return x + 1
    return call
  contestants = [harness.Contestant("fast", "baseline", lambda: sleeper("fast", 1)),
                 harness.Contestant("slow", "jaxmercury", lambda: sleeper("slow", 8))]
  settings = harness.Settings(iters=2, warmup=1, sustain_s=0.05)
  records, _ = harness.run_contestants(contestants, (jnp.arange(3.0),), settings)
  fast, slow = ({r["name"]: r for r in records}[n] for n in ("fast", "slow"))
  assert len(fast["times_ms"]) == len(slow["times_ms"]) == 2
  assert all(t >= 1.0 for t in fast["times_ms"]) and all(t >= 8.0 for t in slow["times_ms"])
  assert slow["median_ms"] > fast["median_ms"]
  assert calls["fast"] >= 20 and calls["slow"] >= 6  # blocks of many runs (about 140 and 18 unloaded)
  assert measure.sustained(lambda: jnp.ones(2), 0.01) > 0


def test_clocks_read_nvidia_smi_and_attribute_samples_to_blocks():
  """nvidia-smi's CSV rows (a field it cannot report left out); consecutive runs of one contestant make a block
  (``MIN_BLOCK_S`` long at least); each contestant gets the samples of its blocks' second halves, power summed over
  the GPUs sampled."""
  text = ("0, 2026/11/28 03:00:00.000, 1980, 100.5, 40, 0x0000000000000000\n"
          "0, 2026/11/28 03:00:00.100, [N/A], 101.0, 40, 0x0000000000000000\nindex, timestamp\n")
  (row,) = clocks.parse(text)
  assert row[1:] == (0, 1980.0, 100.5, 40.0, "0x0000000000000000")
  calls = clocks.Calls()
  calls.starts = [("a", 0.0), ("a", 0.5), ("a", 1.0), ("b", 1.1), ("b", 2.1), ("a", 2.2), ("a", 2.25)]
  assert calls.blocks() == [("a", 0.0, 1.0), ("b", 1.1, 2.1)]  # a's last two runs: too short a block
  samples = [(t / 10, gpu, 1000.0 + t, 300.0, 50.0, "0x4") for t in range(25) for gpu in (0, 1)]
  seen = clocks.by_contestant(calls.blocks(), samples)
  assert seen["a"] == {"sm_mhz": 1008, "power_w": 600.0, "temp_c": 50.0, "samples": 12, "gpus": 2,
                       "reasons": ["0x4"]}  # t = 0.5 .. 1.0
  assert seen["b"]["sm_mhz"] == 1018 and seen["b"]["samples"] == 12  # t = 1.6 .. 2.1
  wrapped = calls.wrap("c", lambda: 7)
  assert wrapped() == 7 and calls.starts[-1][0] == "c"


def test_sustained_blocks_record_each_contestants_clock(monkeypatch):
  """``sustain_s``: nvidia-smi (here a stand-in) samples while the blocks run; each timed contestant records the
  clock its blocks ran at."""
  class Sampler:
    def __init__(self):
      self.start = time.time()

    def stop(self):
      end = time.time()
      return [(self.start + k * 0.01, 0, 1500.0, 650.0, 60.0, "0x4") for k in range(int((end - self.start) / 0.01))]
  monkeypatch.setattr(clocks, "Sampler", Sampler)
  contestants = [harness.Contestant(name, role, lambda: jax.jit(lambda x: x * 2))
                 for name, role in (("base", "baseline"), ("mine", "jaxmercury"))]
  records, _ = harness.run_contestants(contestants, (jnp.arange(8.0),), harness.Settings(iters=2, warmup=1,
                                                                                         sustain_s=0.2))
  for r in records:
    assert r["clocks"]["sm_mhz"] == 1500 and r["clocks"]["samples"] >= 10 and r["clocks"]["reasons"] == ["0x4"]


def test_kernel_trace_reads_kernels_by_call():
  """Each GPU kernel of the trace goes to the host call it started in; busy time counts overlaps once."""
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #14(Compute)"}},
          {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "XLA Ops"}}]
  x = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
  gpu1 = [{"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:1"}},
          {"ph": "M", "name": "thread_name", "pid": 3, "tid": 9, "args": {"name": "Stream #14(Compute)"}}]
  events = meta + gpu1 + [x(1, 0, "kernel_trace:ws {a:b}:0", 0, 100), x(1, 0, "kernel_trace:ws {a:b}:1", 200, 110),
                          x(2, 7, "fwd", 10, 30), x(2, 7, "bwd", 30, 50), x(2, 8, "fusion.1", 10, 80),
                          x(2, 7, "fwd", 210, 30), x(2, 7, "bwd", 250, 40), x(3, 9, "peer", 20, 70)]
  calls = kernel_trace.kernels_by_call({"traceEvents": events}, device=0)
  assert calls[("ws {a:b}", 0)]["kernels"] == [("fwd", 10, 30), ("bwd", 30, 50)]  # not "XLA Ops", not GPU 1's
  (step,) = kernel_trace.summary(calls).values()
  assert step["calls"] == 2 and step["wall_ms"] == 0.105
  assert step["span_ms"] == 0.075 and step["busy_ms"] == 0.07  # medians of (70, 80) and (70, 70)
  assert step["kernels_ms"] == {"bwd": 0.045, "fwd": 0.03}
  assert kernel_trace.summary(calls, top=1)["ws {a:b}"]["kernels_ms"] == {"bwd": 0.045, "other": 0.03}
  both = kernel_trace.kernels_by_call({"traceEvents": events})  # every GPU's kernels
  assert both[("ws {a:b}", 0)]["kernels"] == [("fwd", 10, 30), ("bwd", 30, 50), ("peer", 20, 70)]
  assert kernel_trace.gpu_lines({"traceEvents": events}) == [
      "/device:GPU:0: Stream #14(Compute)", "/device:GPU:0: XLA Ops", "/device:GPU:1: Stream #14(Compute)"]


def test_packed_one_gpu_smoke(tmp_path):
  """``benchmarks.packed --mesh 1``: the dense-mask call is the reference and the baseline, the untuned call agrees
  with it, and so does ws_attention with the packed mask as a mask array (interpret mode); ratios to the dense mask
  and the kept pairs' rate from the records; kernel cudnn_packed skipped on the CPU with its reason."""
  out = tmp_path / "one.json"
  packed.main(["--smoke", "--mesh", "1", "--kernels", "cudnn_packed", "--mask_kernels", "ws_attention", "--mixes",
               "uniform", "--out", str(out)])
  results = json.loads(out.read_text())
  assert results["command"].startswith("python -m benchmarks.packed --smoke --mesh 1")
  (case,) = results["cases"]
  rec = {r["name"]: r for r in case["contestants"]}
  assert case["reference"] == case["best_baseline"] == "ulysses_dense" and 0 < case["kept_fraction_of_causal"] < 1
  assert rec["jaxmercury_untuned"]["numerics_ok"] and rec["local_ws_attention_mask_array"]["numerics_ok"]
  dense, untuned = rec["ulysses_dense"]["median_ms"], rec["jaxmercury_untuned"]
  assert untuned["ratio_to_dense_mask"] == pytest.approx(dense / untuned["median_ms"], rel=1e-2)
  assert untuned["kept_rate_of_causal_rate"] == pytest.approx(
      case["unpacked_causal_ms"] * case["kept_fraction_of_causal"] / untuned["median_ms"], rel=1e-2)
  assert "skipped" in rec["local_cudnn_packed"]
