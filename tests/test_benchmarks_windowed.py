"""XLA's windowed einsum, timed in its own process (``benchmarks.xla_windowed``), against the main process.

On 4 H200s with ``--mesh 4`` the subprocess's ``xla_auto_windowed`` disagreed
with its reference (relative error sqrt(3/4) for all-gather GEMMs, sqrt(1/2)
for reduce-scatter ones), while on 2 H200s it agreed. These tests run the
subprocess's code in this process on the simulated CPU mesh (XLA CPU ignores
the windowed-einsum flags; the harness is what is tested): a mesh spec of
``"4"`` on more devices than that and ``""`` give the subprocess the main
process's inputs and reference, and a wrong output (blocks left empty, as on
the GPUs) is flagged by the subprocess, located by block, and flagged again
against the main process's reference.
"""

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from benchmarks import cases, harness, report, xla_windowed
from benchmarks.baselines import gemm
from benchmarks.suites import GemmCase

SEED = 11
CASES = [GemmCase("allgather", 256, 128, 512, "4", layer="t.up"),
         GemmCase("reducescatter", 256, 512, 128, "4", layer="t.down")]


@pytest.fixture
def windowed_env(monkeypatch):
  """The flags ``xla_windowed`` insists on (they do nothing on CPU once JAX runs)."""
  monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {gemm.WINDOWED_EINSUM_FLAGS}")


def _run_subprocess_code(tmp_path, case_list):
  spec = tmp_path / "spec.json"
  out = tmp_path / "out.json"
  spec.write_text(json.dumps({"cases": [dataclasses.asdict(c) for c in case_list], "seed": SEED, "iters": 2,
                              "warmup": 1, "max_timing_s": 1.0, "deadline": time.time() + 600,
                              "prng_impl": None}))
  assert xla_windowed.main(["--spec", str(spec), "--out", str(out)]) == 0
  return json.loads(out.read_text())["cases"]


def _main_process(case, seed=SEED):
  """What ``cases.run_gemm`` holds for the case: its inputs' and its reference's sketches."""
  mesh = harness.make_mesh(case.mesh)
  x, w = cases.gemm_inputs(seed, case, mesh)
  ref_fn = gemm.allgather_dot if case.kind == "allgather" else gemm.dot_psum_scatter
  y = ref_fn(mesh, cases.mesh_axis(mesh))(x, w)
  name = "allgather_dot" if case.kind == "allgather" else "dot_psum_scatter"
  return {"inputs": [harness.sketch(x), harness.sketch(w)], "reference": harness.sketch(y), "name": name}


def test_mesh_spec_4_is_the_first_4_devices_on_one_level():
  four, every = harness.make_mesh("4"), harness.make_mesh("")
  assert four.axis_names == every.axis_names == ("gpu",)
  assert list(four.devices.flat) == jax.devices()[:4] and list(every.devices.flat) == jax.devices()


@pytest.mark.usefixtures("windowed_env")
@pytest.mark.parametrize("mesh_spec", ["4", ""])
def test_the_subprocess_sees_the_main_process_inputs_and_agrees(tmp_path, mesh_spec):
  case_list = [dataclasses.replace(c, mesh=mesh_spec) for c in CASES]
  recs = _run_subprocess_code(tmp_path, case_list)
  for case in case_list:
    rec = recs[case.name]
    assert rec["numerics_ok"] is True and rec["rel_err"] < harness.BF16_TOLERANCE and rec["median_ms"] > 0, rec
    assert "block_errors" not in rec
    checked = cases.cross_check_windowed(rec, _main_process(case))
    assert checked["inputs_match"] is True, checked
    assert checked["rel_err_vs_main"] < 1e-2 and checked["reference_rel_err_vs_main"] < 1e-2, checked
    assert checked["numerics_ok"] is True and "main process" in checked["agreement_checked_against"]
    assert not {"inputs_sketch", "output_sketch", "reference_sketch"} & set(checked)  # kept in the subprocess's


def _leaves_blocks_empty(original):
  """``gemm.xla_auto`` whose output keeps only its first row block of n: what the GPUs returned."""
  def xla_auto(mesh, level, kind):
    fn, n = original(mesh, level, kind), mesh.devices.size
    out = NamedSharding(mesh, gemm.layouts(kind, level)[2])
    return jax.jit(lambda a, b: fn(a, b).at[a.shape[0] // n:].set(0), out_shardings=out)
  return xla_auto


@pytest.mark.usefixtures("windowed_env")
def test_a_wrong_windowed_output_is_located_and_flagged_against_the_main_reference(tmp_path, monkeypatch):
  monkeypatch.setattr(gemm, "xla_auto", _leaves_blocks_empty(gemm.xla_auto))
  recs = _run_subprocess_code(tmp_path, CASES)
  for case in CASES:
    rec = recs[case.name]
    assert rec["numerics_ok"] is False and rec["rel_err"] == pytest.approx(np.sqrt(3 / 4), abs=0.02), rec
    where = rec["block_errors"]
    assert where["grid"].startswith("4 x 4 blocks")
    ratio = np.asarray(where["norm_ratio"])  # row blocks 1..3 empty, row block 0 right
    assert np.all(ratio[1:] == 0) and np.allclose(ratio[0], 1, atol=0.02), where
    checked = cases.cross_check_windowed(rec, _main_process(case))
    assert checked["inputs_match"] is True and checked["numerics_ok"] is False
    assert checked["rel_err_vs_main"] == pytest.approx(np.sqrt(3 / 4), rel=0.3), checked
    assert checked["reference_rel_err_vs_main"] < 1e-2  # the subprocess's reference is right: the output is not
    results = {"cases": [{"name": case.name, "contestants": [checked]}]}
    (problem,) = report.problems(results)
    assert "xla_auto_windowed disagrees" in problem and "of the main process" in problem


@pytest.mark.usefixtures("windowed_env")
def test_inputs_that_differ_from_the_main_process_are_flagged(tmp_path):
  (case,) = CASES[:1]
  rec = _run_subprocess_code(tmp_path, [case])[case.name]
  checked = cases.cross_check_windowed(rec, _main_process(case, seed=SEED + 1))
  assert checked["inputs_match"] is False and checked["numerics_ok"] is False
  assert "inputs differ" in checked["disagreement"] and "rel_err_vs_main" not in checked
  assert "inputs differ" in report.status(checked)


def test_sketches_estimate_the_relative_error():
  mesh = harness.make_mesh("4")
  sharding = NamedSharding(mesh, gemm.layouts("allgather", "gpu")[2])
  y = jax.device_put(jax.random.normal(jax.random.key(0), (256, 512), jnp.float32), sharding)
  noise = jax.device_put(0.01 * jax.random.normal(jax.random.key(1), (256, 512), jnp.float32), sharding)
  same = harness.sketch(jax.device_put(y, NamedSharding(mesh, gemm.layouts("allgather", "gpu")[0])))
  assert harness.sketch_rel_err(same, harness.sketch(y)) < harness.SKETCH_TOLERANCE  # any layout, one sketch
  assert harness.sketch_rel_err(harness.sketch(y + noise), harness.sketch(y)) == pytest.approx(0.01, rel=0.3)
  assert harness.sketch_rel_err(harness.sketch(y.at[64:].set(0)), harness.sketch(y)) == pytest.approx(
      np.sqrt(3 / 4), rel=0.3)
