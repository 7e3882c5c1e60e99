"""One benchmark case: jaxmercury's tuned operator and every baseline, on the same inputs.

For a case the runner (``benchmarks.run``):

1. tunes jaxmercury with ``jm.autotune`` for the callers' layouts (attention:
   q, k, v and o sequence-sharded over every mesh level; all-gather GEMM: x
   row-sharded, w and the output column-sharded; reduce-scatter GEMM: x
   column-sharded, w and the output row-sharded);
2. measures the physical floor: one rank's share of the compute on one
   device, and the fewest bytes a device must receive at the measured link
   bandwidth;
3. places fresh random normal inputs once, in the callers' layout, and
   compiles, warms up, times (interleaved) and cross-checks the tuner's
   winner and every baseline on them.
"""

from __future__ import annotations

import json
import math
import time
import zlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import jaxmercury as jm
from jaxmercury.tuner.cost import Machine

from benchmarks import harness
from benchmarks.baselines import attention as attn
from benchmarks.baselines import gemm
from benchmarks.suites import AttentionCase, GemmCase

ATTENTION_ORDER = ("cp_allgather", "ring", "ulysses", "usp", "jaxmercury")
GEMM_ORDER = ("allgather_dot", "dot_psum_scatter", "xla_auto", "pallas_mgpu", "jaxmercury")

# The cost model's figures on the simulated CPU mesh of --smoke (calibrating takes ~30 s there).
SMOKE_MACHINE = Machine(name="simulated CPU (fixed figures, not calibrated)", flops_per_s=2e10,
                        link_bytes_per_s={"*": 2e8}, latency_s=1e-4, kernel_flops_per_s={"xla": 2e10},
                        call_overhead_s=1e-4, memory_bytes_per_s=1e10)


def case_key(seed: int, name: str):
  """The PRNG key of a case's inputs: the same in every process for the same seed and case."""
  return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()))


def mesh_axis(mesh):
  """The mesh's levels as one shard_map axis: a name, or a tuple (major first)."""
  names = tuple(mesh.axis_names)
  return names[0] if len(names) == 1 else names


def _short(text: str, n: int = 200) -> str:
  return text if len(text) <= n else text[:n] + " ..."


# ------------------------------------------------------------------ tuner


def tune(env, prog, mesh, family: str, size: int, in_shardings, out_sharding):
  """``jm.autotune`` for the callers' layouts; returns ``(TuneResult or None, record)``.

  When the tuner itself fails (for instance out of memory: it builds its
  inputs and its reference output on one device), the sweep's last winner,
  tuned at a smaller size, is replayed on this size instead (recorded as
  ``replayed``) so that jaxmercury's schedules are still timed. So it is,
  without tuning, when one call does more than ``--tune_max_tflop`` per
  device: the tuner's single-device reference and its repeated timing of
  every candidate would take longer than a run's budget.
  """
  rec = {}
  t0 = time.perf_counter()
  work = prog.flops / mesh.devices.size
  if work > env.args.tune_max_tflop * 1e12 and family in env.winners:
    rec["not_tuned"] = (f"{work / 1e12:.0f} TFLOP per device per call, above --tune_max_tflop "
                        f"{env.args.tune_max_tflop:g}")
    harness.log(f"  not tuning: {rec['not_tuned']}")
    return _replay(env, prog, mesh, family, rec, in_shardings, out_sharding)
  try:
    machine = env.machine(family, size, prog, mesh)
    rec["machine"] = machine.name
    limit = env.candidate_limit()
    result = jm.autotune(prog, mesh, in_shardings=in_shardings, out_sharding=out_sharding,
                         top_k=env.args.top_k, space=env.args.space, iters=env.args.tune_iters,
                         time_limit_s=limit, machine=machine, database=env.database,
                         key=jax.random.key(env.args.seed), log=lambda s: harness.log("    " + s))
  except Exception as exc:  # noqa: BLE001 - the tuner failing is jaxmercury failing
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    rec["error"] = harness.error_text(exc)
    harness.log(f"  tuner ERROR: {rec['error']}")
    return _replay(env, prog, mesh, family, rec, in_shardings, out_sharding)
  rec["wall_s"] = round(time.perf_counter() - t0, 2)
  rec["from_database"] = result.from_database
  rec["candidates"] = [{"name": c.name, "predicted_ms": _finite(c.predicted_ms), "time_ms": c.time_ms,
                        "memory_bytes": c.memory_bytes,
                        "compiled_bytes": c.result.compiled_bytes if c.result else None,
                        "status": c.status, "reason": _short(c.result.reason) if c.result else ""}
                       for c in result.candidates]
  if result.best is None and _timed_out_by_budget(env, result, limit):
    rec["skipped"] = f"{harness.OUT_OF_TIME}: every tuner candidate timed out at the budget's {limit:.0f} s"
    rec["out_of_time"] = True
    harness.log(f"  tuner: {rec['skipped']}")
    try:  # the stored time-outs would fail them again on --resume
      env.database.clear_measurements(prog, mesh, (in_shardings, out_sharding))
    except Exception as exc:  # noqa: BLE001
      harness.log(f"  (could not clear the tuner's time-outs: {exc})")
  elif result.best is not None:
    rec["winner"] = result.best.name
    rec["winner_ms"] = result.best.time_ms
    rec["winner_trace"] = result.best.schedule.to_json()
    env.winners[family] = (size, result.best.name, rec["winner_trace"])
    harness.log(f"  tuner: {len(result.candidates)} candidates in {rec['wall_s']:.1f} s; winner "
                f"{result.best.name} ({result.best.time_ms:.3f} ms)")
  else:
    reasons = sorted({c.result.reason.split(':')[0] for c in result.candidates if c.result})
    rec["error"] = "no candidate passed: " + "; ".join(reasons)[:300]
    harness.log(f"  tuner: {rec['error']}")
  return result, rec


def _timed_out_by_budget(env, result, limit: float) -> bool:
  """No winner only because the candidates' time limit was cut to the budget's remainder and all timed out."""
  failed = [c for c in result.candidates if c.result is not None and c.status == "failed"]
  return (limit < env.args.candidate_time_limit and bool(failed)
          and all(c.result.reason.startswith("time-out") for c in failed))


class _Replayed:
  """A stand-in for a ``TuneResult`` holding only a replayed winner."""

  def __init__(self, name, schedule):
    self.best = type("Best", (), {"name": name, "schedule": schedule})()
    self.candidates = []


def _replay(env, prog, mesh, family, rec, in_shardings, out_sharding):
  """The winner's primitives (trace steps) applied to this size's program, for the same layouts."""
  from jaxmercury.schedules.trace import replay
  held = env.winners.get(family)
  if held is None:
    return None, rec
  size, name, trace = held
  try:
    fresh = jm.Schedule(prog, mesh, in_shardings=in_shardings, out_sharding=out_sharding)
    schedule = replay(fresh, json.loads(trace)["steps"])
    schedule.plan()
  except Exception as exc:  # noqa: BLE001 - the old winner does not fit this size
    rec["replay_error"] = harness.error_text(exc)
    return None, rec
  rec["replayed"] = f"{name}, the winner at size {size}"
  rec["winner"] = f"{name} (winner at size {size}, replayed)"
  harness.log(f"  replaying the sweep's last winner: {rec['replayed']}")
  return _Replayed(rec["winner"], schedule), rec


def _tune_unless(avoid, env, *args):
  """``tune(env, *args)``, unless jaxmercury already failed at a smaller size of the sweep or time is up."""
  if "jaxmercury" in avoid:
    return None, {"skipped": avoid["jaxmercury"]}
  if time.time() > env.deadline:
    return None, {"skipped": harness.OUT_OF_TIME, "out_of_time": True}
  return tune(env, *args)


def _finite(x):
  return x if x is not None and math.isfinite(x) else None


def jaxmercury_contestant(result, tuned: dict) -> harness.Contestant:
  """The tuner's winner, compiled for the callers' layouts."""
  if "skipped" in tuned:
    late = {"out_of_time": True} if tuned.get("out_of_time") else {}
    return harness.Contestant("jaxmercury", "jaxmercury", None, "jaxmercury (autotuned)", skip=tuned["skipped"],
                              record=late)
  if result is None or result.best is None:
    return harness.Contestant("jaxmercury", "jaxmercury", None, "jaxmercury (autotuned)",
                              record={"error": "tuner: " + tuned.get("error", "no result")})
  best = result.best
  return harness.Contestant("jaxmercury", "jaxmercury", lambda: best.schedule.compile(differentiable=False),
                            f"jaxmercury autotune winner: {best.name}", record={"schedule": best.name})


# ------------------------------------------------------------------ cases


def _contestants_failed_before(contestants, avoid: dict):
  """Marks the contestants that failed at a smaller size of the sweep as skipped."""
  for c in contestants:
    if c.name in avoid and not c.skip:
      c.skip = avoid[c.name]
  return contestants


def _run(env, contestants, inputs, order, keep=None):
  """Prepares and cross-checks (in ``order``), then times the contestants of one case.

  Args:
    keep: called as ``keep(reference name, reference output)`` before the
      reference output is freed (None: nothing ran).
  """
  pre_errors = {c.name: c.record.pop("error") for c in contestants if "error" in c.record}
  for c in contestants:
    if c.name in pre_errors:
      c.build = _raiser(pre_errors[c.name])
  prep = harness.prepare(contestants, inputs, warmup=env.warmup, iters=env.args.iters,
                         max_timing_s=env.args.max_timing_s, order=order, deadline=env.deadline)
  records, ref_name = prep.records, prep.reference
  for c in contestants:  # build() may have added fields (e.g. the Pallas configuration)
    records[c.name].update({k: v for k, v in c.record.items() if k not in records[c.name]})
  extra = {}
  if env.args.smoke and ref_name is not None and env.program_reference is not None:
    err = float(harness.rel_err(prep.reference_output, env.program_reference(inputs)))
    extra["reference_vs_program"] = err
    if err >= harness.BF16_TOLERANCE:
      harness.log(f"  !!! the reference {ref_name} disagrees with the program's own reference: {err:.3e}")
  if keep is not None:
    keep(ref_name, prep.reference_output)
  prep.reference_output = None  # free it before timing
  times = harness.time_interleaved(prep.ready, records, inputs)
  harness.summarize(records, times)
  prep.ready.clear()
  return records, ref_name, extra


def _raiser(text):
  """A ``build`` that fails with ``text`` (a contestant that failed before it could be built)."""
  def build():
    raise RuntimeError(text)
  return build


def run_attention(env, case: AttentionCase, avoid: dict) -> dict:
  """Times jaxmercury and the attention baselines on one configuration; the case's record."""
  mesh = env.mesh(case.mesh)
  levels = tuple(mesh.axis_names)
  n = mesh.devices.size
  dtype = jnp.dtype(case.dtype)
  b, h, kv, d, s = case.batch, case.heads, case.kv_heads, case.head_dim, case.seq
  prog = jm.programs.attention(b, h, kv, s, s, d, causal=case.causal, dtype=dtype)
  spec = attn.seq_spec(levels)
  out = {"mesh": dict(mesh.shape), "flops_per_device": prog.flops / n}

  result, tuned = _tune_unless(avoid, env, prog, mesh, case.family, s, (spec,) * 3, spec)
  out["tuner"] = tuned
  if result is not None and result.candidates and env.is_fig13(case):
    out["fig13_plot"] = env.tuner_plot(result, case)

  out["floor"] = attention_floor(env, case, mesh, prog)
  impl = env.impl
  contestants = [jaxmercury_contestant(result, tuned)]
  contestants.append(harness.Contestant(
      "cp_allgather", "baseline", lambda: attn.context_parallel(mesh, levels, causal=case.causal, impl=impl),
      f"context parallel: all-gathered K/V + {impl}"))
  contestants.append(harness.Contestant(
      "ring", "baseline", lambda: attn.ring(mesh, levels, causal=case.causal, impl=impl),
      f"RingAttention: blockwise, K/V ppermute ring + {impl}"))
  why = _heads_problem(h, kv, n)
  contestants.append(harness.Contestant(
      "ulysses", "baseline",
      lambda: attn.ulysses(mesh, levels, causal=case.causal, impl=impl, heads=h, kv_heads=kv),
      f"DeepSpeed-Ulysses: all-to-all + {impl}", skip=why and f"ulysses: {why}"))
  if len(levels) == 2:
    why = _heads_problem(h, kv, mesh.shape[levels[1]])
    skip = why and f"usp: {why} of the inner level"
  else:
    skip = "USP needs a two-level mesh (run with --mesh AxB)"
  contestants.append(harness.Contestant(
      "usp", "baseline", lambda: attn.usp(mesh, levels, causal=case.causal, impl=impl, heads=h, kv_heads=kv),
      f"USP: Ulysses over {levels[-1]}, ring over {levels[0]} + {impl}", skip=skip))
  _contestants_failed_before(contestants, avoid)

  sharding = NamedSharding(mesh, spec)
  keys = jax.random.split(case_key(env.args.seed, case.name), 3)
  inputs = tuple(harness.random_array(k, bf.shape, dtype, sharding) for k, bf in zip(keys, prog.reads))
  env.program_reference = _program_reference(prog) if env.args.smoke else None
  records, ref_name, extra = _run(env, contestants, inputs, ATTENTION_ORDER)
  del inputs
  out.update(extra)
  return _finish(out, records, ref_name)


def _program_reference(prog):
  """The program's own single-device reference (--smoke sizes only), jitted once."""
  fn = jax.jit(prog.reference)
  return lambda xs: fn(*xs)


def _heads_problem(h: int, kv: int, ranks: int) -> str | None:
  if h % ranks:
    return f"{h} query heads do not split over {ranks} ranks"
  if kv % ranks and ranks % kv:
    return f"{kv} key/value heads neither divide nor are divided by {ranks} ranks"
  return None


def attention_comm_bytes(case: AttentionCase, n: int) -> tuple[float, str]:
  """The fewest bytes a device receives under the baselines' strategies, and which strategy."""
  isz = jnp.dtype(case.dtype).itemsize
  tokens = case.batch * case.seq * case.head_dim * isz  # bytes of one head over the whole sequence
  options = {"K/V all-gather (context parallel, ring)": 2 * (n - 1) / n * tokens * case.kv_heads}
  if _heads_problem(case.heads, case.kv_heads, n) is None:
    kv = max(case.kv_heads, n) if case.kv_heads % n else case.kv_heads
    options["q, k, v, o all-to-all (Ulysses)"] = (n - 1) / n * tokens * (2 * case.heads + 2 * kv) / n
  how = min(options, key=options.get)
  return options[how], how


def attention_floor(env, case: AttentionCase, mesh, prog) -> dict:
  """Compute: one rank's share on one device (its rate); communication: fewest bytes at link speed."""
  n = mesh.devices.size
  b, h, kv, d, s = case.batch, case.heads, case.kv_heads, case.head_dim, case.seq
  dtype = jnp.dtype(case.dtype)
  device = mesh.devices.flat[0]
  fn = attn.local_share(causal=False, impl=env.impl)
  key = case_key(env.args.seed + 1, case.name)
  compute_ms, how = None, ""
  per_device = prog.flops / n
  for q_len, k_len, what in ((s // n, s, "one rank's queries against every key"),
                             (s // n, s // n, "one rank's queries against one rank's keys")):
    try:
      flops = 4.0 * b * q_len * k_len * h * d
      ms = harness.compute_floor(fn, [(b, q_len, h, d), (b, k_len, kv, d), (b, k_len, kv, d)], dtype, device,
                                 key)
      rate = flops / (ms * 1e-3)
      compute_ms = per_device / rate * 1e3
      how = (f"{what}, non-causal {env.impl} on one device: {ms:.3f} ms, {rate / 1e12:.1f} TFLOP/s; "
             f"this device's {'causal ' if case.causal else ''}work at that rate")
      break
    except Exception as exc:  # noqa: BLE001 - try a smaller block
      how = f"{what}: {harness.error_text(exc)}"
  comm_bytes, comm_how = attention_comm_bytes(case, n)
  link = env.link(mesh)
  return harness.floor_record(compute_ms=compute_ms, compute_how=how, comm_bytes=comm_bytes, link=link,
                              comm_how=comm_how)


def run_gemm(env, case: GemmCase, avoid: dict) -> dict:
  """Times jaxmercury and the GEMM baselines on one configuration; the case's record."""
  mesh = env.mesh(case.mesh)
  axis = mesh_axis(mesh)
  n = mesh.devices.size
  dtype = jnp.dtype(case.dtype)
  prog = jm.programs.matmul(case.m, case.n, case.k, dtype=dtype)
  x_spec, w_spec, o_spec = gemm.layouts(case.kind, axis)
  out = {"mesh": dict(mesh.shape), "flops_per_device": 2.0 * case.m * case.n * case.k / n}

  result, tuned = _tune_unless(avoid, env, prog, mesh, case.family, case.m, (x_spec, w_spec), o_spec)
  out["tuner"] = tuned
  out["floor"] = gemm_floor(env, case, mesh)

  contestants = [jaxmercury_contestant(result, tuned)]
  if case.kind == "allgather":
    contestants.append(harness.Contestant("allgather_dot", "baseline", lambda: gemm.allgather_dot(mesh, axis),
                                          "shard_map: all_gather(x) then dot"))
  else:
    contestants.append(harness.Contestant("dot_psum_scatter", "baseline",
                                          lambda: gemm.dot_psum_scatter(mesh, axis),
                                          "shard_map: dot then psum_scatter"))
  contestants.append(harness.Contestant("xla_auto", "baseline", lambda: gemm.xla_auto(mesh, axis, case.kind),
                                        "jit with sharded operands, XLA partitions the dot (default flags)"))
  if case.kind == "allgather":
    contestants.append(pallas_contestant(env, mesh, axis, dtype))
  _contestants_failed_before(contestants, avoid)

  inputs = gemm_inputs(env.args.seed, case, mesh)
  env.program_reference = _program_reference(prog) if env.args.smoke else None
  env.current_inputs = inputs
  windowed = env.windowed_result(case)
  here = {}

  def keep(ref_name, output):  # what the windowed-einsum subprocess's record is checked against
    if windowed is not None and "output_sketch" in windowed and output is not None:
      here.update(inputs=[harness.sketch(x) for x in env.current_inputs], reference=harness.sketch(output),
                  name=ref_name)

  records, ref_name, extra = _run(env, contestants, inputs, GEMM_ORDER, keep=keep)
  env.current_inputs = None
  del inputs
  out.update(extra)
  if windowed is not None:
    records["xla_auto_windowed"] = cross_check_windowed(windowed, here)
  return _finish(out, records, ref_name)


def cross_check_windowed(rec: dict, here: dict) -> dict:
  """The windowed-einsum subprocess's record, checked against this process's inputs and reference.

  The subprocess compares its output with a reference compiled under the
  same XLA flags. Here its sketches (``harness.sketch``) are compared with
  those of this process's inputs and of the reference every other contestant
  of the case was checked against: ``inputs_match`` (the subprocess had the
  same inputs), ``rel_err_vs_main`` (its output against that reference) and
  ``reference_rel_err_vs_main`` (its own reference against it), both
  estimated from the sketches. ``numerics_ok`` holds only when the
  subprocess's check and this one pass.

  Args:
    rec: the subprocess's record (``benchmarks.xla_windowed``); its sketches are left out of the
      returned copy (the results file keeps them under ``windowed_subprocess``).
    here: ``{"inputs": [sketch, ...], "reference": sketch, "name": reference's name}``; empty when
      nothing ran here (the record is returned as it is).
  """
  rec = dict(rec)
  sketches = {k: rec.pop(k) for k in ("inputs_sketch", "output_sketch", "reference_sketch") if k in rec}
  if len(sketches) < 3 or not here:  # they stay in the results' "windowed_subprocess"
    return rec
  diffs = [harness.sketch_rel_err(a, b) for a, b in zip(sketches["inputs_sketch"], here["inputs"])]
  rec["inputs_match"] = len(diffs) == len(here["inputs"]) and max(diffs) < harness.SKETCH_TOLERANCE
  if not rec["inputs_match"]:
    rec["numerics_ok"] = False
    rec["disagreement"] = ("its inputs differ from the main process's (relative difference of the sketches "
                           f"{', '.join(f'{d:.1e}' for d in diffs)}): a harness bug, the outputs are not comparable")
  else:
    err = harness.sketch_rel_err(sketches["output_sketch"], here["reference"])
    rec["rel_err_vs_main"] = err
    rec["reference_rel_err_vs_main"] = harness.sketch_rel_err(sketches["reference_sketch"], here["reference"])
    if not err < harness.BF16_TOLERANCE:
      rec["disagreement"] = (f"relative error {err:.2e} against {here['name']} of the main process (estimated "
                             f"from sketches); the subprocess's own reference differs from it by "
                             f"{rec['reference_rel_err_vs_main']:.1e}")
    rec["numerics_ok"] = bool(rec.get("numerics_ok", True) and err < harness.BF16_TOLERANCE)
  rec["agreement_checked_against"] = (f"{rec.get('agreement_checked_against', 'nothing')}; and, by sketches, "
                                      f"{here['name']} in the main process on the same inputs")
  harness.log(f"  xla_auto_windowed (subprocess): inputs {'match' if rec['inputs_match'] else 'DIFFER'}"
              + (f", rel err {rec['rel_err_vs_main']:.1e} against {here['name']} here" if "rel_err_vs_main" in rec
                 else ""))
  return rec


def gemm_inputs(seed: int, case: GemmCase, mesh):
  """``(x, w)`` of a GEMM case in the callers' layouts: the same in every process for the same seed and mesh."""
  x_spec, w_spec, _ = gemm.layouts(case.kind, mesh_axis(mesh))
  dtype = jnp.dtype(case.dtype)
  keys = jax.random.split(case_key(seed, case.name), 2)
  return (harness.random_array(keys[0], (case.m, case.k), dtype, NamedSharding(mesh, x_spec)),
          harness.random_array(keys[1], (case.k, case.n), dtype, NamedSharding(mesh, w_spec)))


def gemm_floor(env, case: GemmCase, mesh) -> dict:
  n = mesh.devices.size
  dtype = jnp.dtype(case.dtype)
  if case.kind == "allgather":
    shapes = [(case.m, case.k), (case.k, case.n // n)]
    comm = (n - 1) / n * case.m * case.k * dtype.itemsize
    comm_how = "all-gather of x"
  else:
    shapes = [(case.m, case.k // n), (case.k // n, case.n)]
    comm = (n - 1) / n * case.m * case.n * dtype.itemsize
    comm_how = f"reduce-scatter of the output in {dtype.name}"
  what = " @ ".join(f"[{a}, {b}]" for a, b in shapes)
  try:
    ms = harness.compute_floor(gemm.local_share(case.kind), shapes, dtype, mesh.devices.flat[0],
                               case_key(env.args.seed + 1, case.name))
    how = f"one rank's GEMM {what} on one device"
  except Exception as exc:  # noqa: BLE001
    ms, how = None, f"one rank's GEMM {what}: {harness.error_text(exc)}"
  return harness.floor_record(compute_ms=ms, compute_how=how, comm_bytes=comm, link=env.link(mesh),
                              comm_how=comm_how)


def pallas_contestant(env, mesh, axis, dtype) -> harness.Contestant:
  """JAX's Mosaic GPU all-gather matmul, the fastest of a few tile configurations (Hopper only)."""
  label = "Pallas Mosaic GPU collective_matmul_mgpu.all_gather_lhs_matmul"
  why = gemm.pallas_unavailable(mesh, dtype)
  c = harness.Contestant("pallas_mgpu", "baseline", None, label, skip=why)
  if why:
    return c

  def build():
    best, errors = None, []
    x_spec, w_spec, _ = gemm.layouts("allgather", axis)
    x, w = env.current_inputs
    for config in gemm.PALLAS_CONFIGS:
      try:
        fn = gemm.pallas_allgather_matmul(mesh, axis, config, dtype)
        compiled = fn.lower(x, w).compile()
        ms = harness.time_call(compiled, (x, w), iters=5)
        if best is None or ms < best[0]:
          best = (ms, compiled, config)
      except Exception as exc:  # noqa: BLE001 - a configuration that does not fit
        errors.append(f"{config}: {harness.error_text(exc)}")
    if best is None:
      raise RuntimeError("no tile configuration ran: " + " | ".join(errors)[:600])
    c.record["config"] = list(best[2])
    c.record["configs_failed"] = len(errors)
    return best[1]

  c.build = build
  return c


def _finish(out: dict, records: dict, ref_name) -> dict:
  order = list(records)
  contestants = [records[k] for k in order]
  floor_ms = out.get("floor", {}).get("floor_ms")
  best = harness.rank(contestants, floor_ms, out.get("flops_per_device"))
  out["reference"] = ref_name
  out["best_baseline"] = best["name"] if best else None
  out["best_baseline_ms"] = best["median_ms"] if best else None
  out["contestants"] = contestants
  timed = [r for r in contestants if "median_ms" in r]
  late = [r["name"] for r in contestants if harness.out_of_time(r)]
  if late:  # no failure: the case is left for --resume
    out["out_of_time"] = late
  if timed:
    out["status"] = "ok"
  elif late:
    out["status"], out["skipped"] = "skipped", f"{harness.OUT_OF_TIME} before any contestant was timed"
  else:
    out["status"] = "failed"
  out["agree"] = all(r.get("numerics_ok", True) for r in timed)
  return out
