"""XLA's automatic collective matmul (windowed einsum), timed in a process of its own.

XLA reads ``XLA_FLAGS`` once, when JAX starts its backend, and the
windowed-einsum flags (``benchmarks.baselines.gemm.WINDOWED_EINSUM_FLAGS``)
would also change how XLA compiles every other contestant. So
``benchmarks.run`` starts this module before its own JAX starts (the GPUs are
then free), with the flags added to ``XLA_FLAGS``, for every GEMM case it
plans; the results wait in the results file until the main process reaches
each case and merges them in as the contestant ``xla_auto_windowed``.

Each case gets the same inputs as in the main process (the same key, mesh and
layouts) and its output is checked against a ``shard_map`` collective + dot
run here. As that reference is compiled under the same flags, the record also
carries sketches (``harness.sketch``: small random projections, computed shard
by shard with no partitioned dot) of the inputs, of the output and of this
reference; the main process compares them with its own inputs and its own
reference (``benchmarks.cases.cross_check_windowed``). A disagreement records
which blocks of the output are wrong (``block_errors``).

  python -m benchmarks.xla_windowed --spec spec.json --out windowed.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _write(path, data):
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)
  os.replace(tmp, path)


def fingerprints(fn, inputs, reference, blocks: int, agrees: bool) -> dict:
  """Sketches of the inputs, of ``fn``'s output and of the reference; where they differ if they do."""
  from benchmarks import harness
  y = fn(*inputs)
  out = {"inputs_sketch": [harness.sketch(x) for x in inputs], "output_sketch": harness.sketch(y),
         "reference_sketch": harness.sketch(reference)}
  if not agrees:
    out["block_errors"] = harness.block_errors(y, reference, blocks)
    if out["block_errors"]:
      harness.log(f"  xla_auto_windowed against the reference, {out['block_errors']['grid']}:\n"
                  f"    rel err {out['block_errors']['rel_err']}\n    norm ratio {out['block_errors']['norm_ratio']}")
  del y
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--spec", required=True, help="JSON: cases, seed, iters, warmup, max_timing_s, deadline")
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  with open(args.spec, encoding="utf-8") as f:
    spec = json.load(f)
  from benchmarks.baselines import gemm
  if gemm.WINDOWED_EINSUM_FLAGS.split()[0] not in os.environ.get("XLA_FLAGS", ""):
    print("xla_windowed: XLA_FLAGS lacks the windowed-einsum flags; refusing to run", file=sys.stderr)
    return 2

  import jax  # noqa: E402 - after the flags are checked
  if spec.get("prng_impl"):
    jax.config.update("jax_default_prng_impl", spec["prng_impl"])  # as in the main process
  from benchmarks import harness
  from benchmarks.cases import gemm_inputs, mesh_axis
  from benchmarks.suites import case_from_dict

  results = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "device": jax.devices()[0].device_kind,
             "cases": {}}
  label = f"jit with sharded operands, XLA partitions the dot, XLA_FLAGS += {gemm.WINDOWED_EINSUM_FLAGS}"
  for data in spec["cases"]:
    case = case_from_dict(data)
    rec = {"name": "xla_auto_windowed", "role": "baseline", "label": label, "process": "separate"}
    results["cases"][case.name] = rec
    if time.time() > spec["deadline"]:
      rec["skipped"], rec["out_of_time"] = f"{harness.OUT_OF_TIME} (windowed-einsum subprocess)", True
      continue
    harness.log(f"\n== [xla_windowed] {case.name}")
    try:
      mesh = harness.make_mesh(case.mesh)
      axis = mesh_axis(mesh)
      inputs = gemm_inputs(spec["seed"], case, mesh)  # as the main process makes them
      ref = gemm.allgather_dot if case.kind == "allgather" else gemm.dot_psum_scatter
      contestants = [harness.Contestant("reference", "baseline", lambda: ref(mesh, axis), "shard_map reference"),
                     harness.Contestant("xla_auto_windowed", "baseline",
                                        lambda: gemm.xla_auto(mesh, axis, case.kind), label)]
      prep = harness.prepare(contestants, inputs, warmup=spec["warmup"], iters=spec["iters"],
                             max_timing_s=spec["max_timing_s"], order=("reference",), deadline=spec["deadline"])
      ready, records = prep.ready, prep.records
      if "xla_auto_windowed" in ready and prep.reference == "reference":
        rec.update(fingerprints(ready["xla_auto_windowed"].fn, inputs, prep.reference_output, mesh.devices.size,
                                records["xla_auto_windowed"].get("numerics_ok", True)))
      prep.reference_output = None
      times = harness.time_interleaved(ready, records, inputs)
      harness.summarize(records, times)
      rec.update({k: v for k, v in records["xla_auto_windowed"].items() if k not in ("name", "role", "label")})
      if "median_ms" in records["reference"]:
        rec["reference_ms_here"] = records["reference"]["median_ms"]
      rec["agreement_checked_against"] = "shard_map collective + dot in the same process"
      del inputs
      ready.clear()
    except Exception as exc:  # noqa: BLE001 - record and go on
      rec["error"] = harness.error_text(exc)
      harness.log(f"  ERROR: {rec['error']}")
    _write(args.out, results)
    jax.clear_caches()
  _write(args.out, results)
  return 0


if __name__ == "__main__":
  sys.exit(main())
