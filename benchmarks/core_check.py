"""Times jaxmercury's core schedules against hand-written JAX baselines.

Usage::

  python -m benchmarks.core_check --out results.json            # GPUs, full size
  python -m benchmarks.core_check --out /tmp/smoke.json --smoke # CPU, 2 fake devices

Cases (one mesh level ``"x"`` over all devices, bf16):

* attention, non-causal, sequence-sharded: jaxmercury ``ring`` and
  ``context_parallel`` (with the ``cudnn_attention`` kernel patched in when the
  registry offers it, and with the XLA body where it fits) against the
  baseline ``context_parallel_attention`` (all-gathered K/V, cuDNN on GPU).
  Also timed: the floor (one rank's queries against all keys, no
  communication) and the communication alone (all-gather of K and V; the
  ring's ``n - 1`` ``ppermute`` steps).
* all-gather matmul: jaxmercury ``allgather_matmul`` and ``async_tp`` against
  the baseline ``allgather_matmul``; floor = the local GEMM
  [M, K] x [K, N/n]; communication alone = all-gather (and ppermute ring) of x.

``--smoke`` runs tiny shapes on CPU and adds a causal attention case and a
reduce-scatter matmul case, so that every baseline is checked numerically
(against the program's single-device reference as well).

Every contestant's output is compared with the baseline's (relative Frobenius
error in float32, below 2e-2 for bf16). Results go to a JSON file and a
markdown table. The exit status is 1 when any contestant failed or disagreed.
"""

from __future__ import annotations

import os
import sys


def _preconfigure(argv):
  """Selects 2 simulated CPU devices for ``--smoke``; must run before jax loads."""
  if "--smoke" in argv:
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()


_preconfigure(sys.argv)

# pylint: disable=wrong-import-position
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmercury as jm  # noqa: E402
from jaxmercury.kernels import registry  # noqa: E402
from jaxmercury.tuner import measure  # noqa: E402

from benchmarks.baselines import xla as base  # noqa: E402

AXIS = base.AXIS
WARMUP = 3
ITERS = 20
TOLERANCE = 2e-2  # relative Frobenius error allowed for bf16
CUDNN_KERNEL = "cudnn_attention"


# ------------------------------------------------------------------ setup


def make_mesh():
  """A one-level mesh ``"x"`` over all devices, with Auto axis types."""
  n = len(jax.devices())
  return jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def place(mesh, x, spec):
  """``x`` laid out over ``mesh`` with ``spec``, ready before timing."""
  return jax.block_until_ready(jax.device_put(x, NamedSharding(mesh, spec)))


@jax.jit
def rel_err(a, b):
  """``||a - b|| / ||b||`` (Frobenius), in float32."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


# ------------------------------------------------------------- contestants


@dataclasses.dataclass
class Entry:
  """One thing timed in a case.

  Attributes:
    name: label in the results.
    role: ``"baseline"``, ``"jaxmercury"``, ``"floor"`` or ``"comm"``.
    build: returns ``(fn, args)``: a jitted function and its placed inputs.
    check: compare its output with the baseline's.
    flops: floating point operations per device per call, for TFLOP/s.
    skip: a reason not to run it (recorded instead of a time).
  """

  name: str
  role: str
  build: Callable | None
  check: bool = False
  flops: float | None = None
  skip: str | None = None


def jm_entry(mesh, prog, strategy, kernel, inputs, flops):
  """A jaxmercury library strategy with a local kernel, inputs in its storage layout."""
  def build():
    s = jm.library(prog, mesh)[strategy]
    if kernel != "xla":
      s.patch(kernel)
    plan = s.plan()
    args = tuple(place(mesh, x, plan.user_spec(b.name)) for b, x in zip(prog.reads, inputs))
    return s.compile(), args

  return Entry(f"jm:{strategy}[{kernel}]", "jaxmercury", build, check=True, flops=flops)


def fixed_entry(name, role, fn, mesh, inputs, specs, flops=None, check=False):
  """A baseline, floor or comm function with inputs placed by ``specs``."""
  def build():
    return fn, tuple(place(mesh, x, s) for x, s in zip(inputs, specs))

  return Entry(name, role, build, check=check, flops=flops)


def skipped(name, role, reason):
  return Entry(name, role, None, skip=reason)


# ----------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  batch: int
  seq: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool = False
  xla_body: bool = True  # also time the schedules with the XLA attention body
  smoke_only: bool = False

  @property
  def name(self):
    tag = " causal" if self.causal else ""
    return f"attention B{self.batch} S{self.seq} H{self.heads} KV{self.kv_heads} D{self.head_dim}{tag}"


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
  m: int
  k: int
  n: int
  kind: str = "allgather"  # or "reducescatter"
  smoke_only: bool = False

  @property
  def name(self):
    return f"matmul {self.kind} {self.m}x{self.k}x{self.n}"


def gpu_cases():
  return [
      AttentionConfig(1, 16384, 32, 32, 128),
      AttentionConfig(1, 32768, 32, 8, 128, xla_body=False),
      MatmulConfig(8192, 8192, 8192),
      MatmulConfig(16384, 8192, 28672),
      MatmulConfig(4096, 8192, 8192),
  ]


def smoke_cases():
  return [
      AttentionConfig(1, 256, 4, 4, 32),
      AttentionConfig(1, 512, 4, 2, 32),
      AttentionConfig(1, 256, 4, 2, 32, causal=True, smoke_only=True),
      MatmulConfig(256, 256, 256),
      MatmulConfig(512, 256, 896),
      MatmulConfig(128, 256, 256),
      MatmulConfig(256, 256, 256, kind="reducescatter", smoke_only=True),
  ]


def attention_entries(mesh, cfg, prog, inputs, impl):
  """Contestants, floor and comm entries of one attention case."""
  n = mesh.shape[AXIS]
  flops = 4 * cfg.batch * cfg.seq * cfg.seq * cfg.heads * cfg.head_dim / n
  flops = flops / 2 if cfg.causal else flops
  seq, rep = P(None, AXIS), P()
  q, k, v = inputs
  entries = [fixed_entry(f"base:cp_allgather[{impl}]", "baseline",
                         base.context_parallel_attention(mesh, cfg.causal, impl),
                         mesh, inputs, (seq,) * 3, flops=flops)]
  patched = CUDNN_KERNEL in registry.candidates(prog, mesh)
  for strategy in ("ring", "context_parallel"):
    if patched:
      entries.append(jm_entry(mesh, prog, strategy, CUDNN_KERNEL, inputs, flops))
    else:
      entries.append(skipped(f"jm:{strategy}[{CUDNN_KERNEL}]", "jaxmercury",
                             f"{CUDNN_KERNEL} is not a registry candidate here"))
    if cfg.xla_body:
      entries.append(jm_entry(mesh, prog, strategy, "xla", inputs, flops))
    else:
      entries.append(skipped(f"jm:{strategy}[xla]", "jaxmercury",
                             "XLA attention body too slow / too big at this size"))
  entries += [
      fixed_entry(f"floor:local_attention[{impl}]", "floor",
                  base.local_attention(mesh, cfg.causal, impl), mesh, inputs, (seq, rep, rep),
                  flops=flops),
      fixed_entry("comm:allgather_kv", "comm", base.allgather_comm(mesh, axis=1, num_inputs=2),
                  mesh, (k, v), (seq, seq)),
      fixed_entry("comm:ppermute_kv", "comm", base.ring_comm(mesh, axis=1, num_inputs=2),
                  mesh, (k, v), (seq, seq)),
  ]
  return entries


def matmul_entries(mesh, cfg, prog, inputs):
  """Contestants, floor and comm entries of one matmul case."""
  n = mesh.shape[AXIS]
  flops = 2 * cfg.m * cfg.k * cfg.n / n
  x, _ = inputs
  row, col, rep = P(AXIS, None), P(None, AXIS), P()
  if cfg.kind == "allgather":
    entries = [fixed_entry("base:allgather_matmul", "baseline", base.allgather_matmul(mesh),
                           mesh, inputs, (row, col), flops=flops)]
    strategies = ("allgather_matmul", "async_tp")
    floor = fixed_entry("floor:local_gemm", "floor", base.local_gemm(mesh), mesh, inputs,
                        (rep, col), flops=flops)
    comm = [fixed_entry("comm:allgather_x", "comm", base.allgather_comm(mesh, axis=0), mesh,
                        (x,), (row,)),
            fixed_entry("comm:ppermute_x", "comm", base.ring_comm(mesh, axis=0), mesh,
                        (x,), (row,))]
  else:
    entries = [fixed_entry("base:matmul_reducescatter", "baseline",
                           base.matmul_reducescatter(mesh), mesh, inputs, (col, row),
                           flops=flops)]
    strategies = ("matmul_reducescatter", "async_tp_reducescatter")
    floor = fixed_entry("floor:local_gemm", "floor", base.local_gemm_reducescatter(mesh), mesh,
                        inputs, (col, row), flops=flops)
    comm = []
  entries += [jm_entry(mesh, prog, s, "xla", inputs, flops) for s in strategies]
  return entries + [floor] + comm


# ---------------------------------------------------------------- timing


def _call(fn, args):
  return jax.block_until_ready(fn(*args))


def _error(exc):
  text = f"{type(exc).__name__}: {exc}"
  return text if len(text) < 2000 else text[:2000] + " ..."


def prepare(entries):
  """Builds, compiles and warms up every entry; failures become records.

  Returns:
    ``(ready, records)``: name -> (fn, args) for the entries that ran, and
    name -> result record (with ``error`` or ``skipped`` for the others).
  """
  ready, records = {}, {}
  for e in entries:
    records[e.name] = {"name": e.name, "role": e.role}
    if e.skip:
      records[e.name]["skipped"] = e.skip
      print(f"  skip {e.name}: {e.skip}", flush=True)
      continue
    try:
      t0 = time.perf_counter()
      fn, args = e.build()
      for _ in range(WARMUP):
        _call(fn, args)
      records[e.name]["warmup_s"] = round(time.perf_counter() - t0, 3)
      ready[e.name] = (fn, args)
      print(f"  ready {e.name} ({records[e.name]['warmup_s']} s compile + warm-up)", flush=True)
    except Exception as exc:  # pylint: disable=broad-except
      records[e.name]["error"] = _error(exc)
      print(f"  ERROR {e.name}: {_error(exc)}", flush=True)
      traceback.print_exc(limit=3)
  return ready, records


def time_interleaved(ready, records, iters=ITERS):
  """Times every ready entry ``iters`` times, one call of each per round.

  The order rotates each round. An entry that fails mid-way is dropped and
  its error recorded.

  Returns:
    name -> list of per-call times in ms.
  """
  def dropped(name, exc):
    records[name]["error"] = _error(exc)
    print(f"  ERROR while timing {name}: {_error(exc)}", flush=True)
    del ready[name]

  return measure.rounds({name: functools.partial(fn, *args) for name, (fn, args) in ready.items()}, iters,
                        on_error=dropped)


def check_numerics(entries, ready, records, baseline):
  """Compares each checked entry's output with the baseline's output."""
  if baseline not in ready:
    return None
  fn, args = ready[baseline]
  ref = _call(fn, args)
  for e in entries:
    if not e.check or e.name not in ready:
      continue
    rec = records[e.name]
    try:
      fn, args = ready[e.name]
      out = _call(fn, args)
      if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} differs from the baseline's {ref.shape}")
      err = float(rel_err(out, ref))
      rec["rel_err"] = err
      rec["numerics_ok"] = bool(err < TOLERANCE)
      del out
      if not rec["numerics_ok"]:
        print(f"  !!! NUMERICS FAILURE {e.name}: rel err {err:.3e} vs baseline "
              f"(tolerance {TOLERANCE})", flush=True)
    except Exception as exc:  # pylint: disable=broad-except
      rec["numerics_ok"] = False
      rec["error"] = _error(exc)
      print(f"  !!! NUMERICS CHECK ERROR {e.name}: {_error(exc)}", flush=True)
  return ref


def summarize(entries, records, times, baseline):
  """Adds median / min / ratio / TFLOP/s to the records, in entry order."""
  for e in entries:
    rec, t = records[e.name], times.get(e.name)
    if not t:
      continue
    rec["median_ms"] = statistics.median(t)
    rec["min_ms"] = min(t)
    if e.flops:
      rec["tflops_per_device"] = e.flops / (rec["median_ms"] * 1e-3) / 1e12
  base_ms = records.get(baseline, {}).get("median_ms")
  for e in entries:
    rec = records[e.name]
    if base_ms and "median_ms" in rec and e.role in ("baseline", "jaxmercury"):
      rec["ratio_to_baseline"] = base_ms / rec["median_ms"]
  return [records[e.name] for e in entries]


def overlap_summary(records, ring, compute, comm, extra_comm=None):
  """How much of the ring's communication its compute hides.

  overlap = (compute + comm - ring) / min(compute, comm): 1 is perfect
  overlap, 0 is none. floor_fraction = max(compute, comm) / ring.
  """
  get = lambda name: records.get(name, {}).get("median_ms")
  ring_ms, compute_ms, comm_ms = get(ring), get(compute), get(comm)
  out = {"ring": ring, "compute": compute, "comm": comm, "ring_ms": ring_ms,
         "compute_ms": compute_ms, "comm_ms": comm_ms}
  if extra_comm:
    out[f"{extra_comm}_ms"] = get(extra_comm)
  if None in (ring_ms, compute_ms, comm_ms):
    out["note"] = "not all of ring / compute / comm ran"
    return out
  floor_ms = max(compute_ms, comm_ms)
  out["overlap"] = (compute_ms + comm_ms - ring_ms) / min(compute_ms, comm_ms)
  out["floor_ms"] = floor_ms
  out["floor_fraction"] = floor_ms / ring_ms
  return out


def attention_overlap(records, impl):
  """The ring whose local kernel matches the floor's is compared with it."""
  kernel = {"cudnn": CUDNN_KERNEL, "xla": "xla"}.get(impl)
  ring = f"jm:ring[{kernel}]"
  if kernel is None or "median_ms" not in records.get(ring, {}):
    return {"note": f"no ring ran with the floor's kernel ({impl})"}
  return overlap_summary(records, ring, f"floor:local_attention[{impl}]", "comm:ppermute_kv",
                         extra_comm="comm:allgather_kv")


# -------------------------------------------------------------- per case


def run_attention(mesh, cfg, key, smoke):
  impl = "xla" if smoke else "cudnn"
  prog = jm.programs.attention(cfg.batch, cfg.heads, cfg.kv_heads, cfg.seq, cfg.seq,
                               cfg.head_dim, causal=cfg.causal, dtype=jnp.bfloat16)
  inputs = prog.random_inputs(key)
  entries = attention_entries(mesh, cfg, prog, inputs, impl)
  case = run_entries(entries, f"base:cp_allgather[{impl}]", prog, inputs, smoke)
  case["overlap"] = attention_overlap({r["name"]: r for r in case["contestants"]}, impl)
  return case


def run_matmul(mesh, cfg, key, smoke):
  prog = jm.programs.matmul(cfg.m, cfg.n, cfg.k, dtype=jnp.bfloat16)
  inputs = prog.random_inputs(key)
  entries = matmul_entries(mesh, cfg, prog, inputs)
  baseline = entries[0].name
  case = run_entries(entries, baseline, prog, inputs, smoke)
  if cfg.kind == "allgather":
    records = {r["name"]: r for r in case["contestants"]}
    case["overlap"] = overlap_summary(records, "jm:async_tp[xla]", "floor:local_gemm",
                                      "comm:ppermute_x", extra_comm="comm:allgather_x")
  return case


def run_entries(entries, baseline, prog, inputs, smoke):
  """Prepares, times and checks one case's entries."""
  ready, records = prepare(entries)
  times = time_interleaved(ready, records)
  ref = check_numerics(entries, ready, records, baseline)
  case = {"baseline": baseline, "contestants": summarize(entries, records, times, baseline)}
  if smoke and ref is not None:
    err = float(rel_err(ref, prog.reference(*inputs)))
    case["baseline_vs_reference"] = err
    if err >= TOLERANCE:
      print(f"  !!! NUMERICS FAILURE baseline vs reference: {err:.3e}", flush=True)
  ready.clear()
  return case


def run_case(mesh, cfg, key, smoke):
  print(f"\n== {cfg.name}", flush=True)
  t0 = time.perf_counter()
  run = run_attention if isinstance(cfg, AttentionConfig) else run_matmul
  try:
    case = run(mesh, cfg, key, smoke)
  except Exception as exc:  # pylint: disable=broad-except
    print(f"  ERROR in case setup: {_error(exc)}", flush=True)
    traceback.print_exc(limit=5)
    case = {"error": _error(exc), "contestants": []}
  case = {"name": cfg.name, "config": dataclasses.asdict(cfg), **case,
          "wall_s": round(time.perf_counter() - t0, 1)}
  gc.collect()
  jax.clear_caches()
  return case


# ---------------------------------------------------------------- report


def _fmt(x, spec):
  return "" if x is None else format(x, spec)


def _status(rec):
  if "skipped" in rec:
    return "skipped: " + rec["skipped"]
  if "error" in rec:
    return "ERROR: " + rec["error"].splitlines()[0][:100]
  if rec.get("numerics_ok") is False:
    return "NUMERICS FAIL"
  return "ok"


def markdown(cases):
  """A markdown table of every entry, then the overlap figures."""
  lines = ["| case | entry | median ms | min ms | x baseline | TFLOP/s/dev | rel err | status |",
           "|---|---|---|---|---|---|---|---|"]
  for case in cases:
    if "error" in case:
      lines.append(f"| {case['name']} | (case) | | | | | | ERROR: {case['error'][:100]} |")
    for rec in case["contestants"]:
      lines.append(
          f"| {case['name']} | {rec['name']} | {_fmt(rec.get('median_ms'), '.3f')} | "
          f"{_fmt(rec.get('min_ms'), '.3f')} | {_fmt(rec.get('ratio_to_baseline'), '.3f')} | "
          f"{_fmt(rec.get('tflops_per_device'), '.3g')} | {_fmt(rec.get('rel_err'), '.2e')} | "
          f"{_status(rec)} |")
  lines += ["", "| case | ring | ring ms | compute ms | comm ms | overlap | floor / ring |",
            "|---|---|---|---|---|---|---|"]
  for case in cases:
    ov = case.get("overlap")
    if not ov:
      continue
    lines.append(
        f"| {case['name']} | {ov.get('ring', '')} | {_fmt(ov.get('ring_ms'), '.3f')} | "
        f"{_fmt(ov.get('compute_ms'), '.3f')} | {_fmt(ov.get('comm_ms'), '.3f')} | "
        f"{_fmt(ov.get('overlap'), '.2f')} | {_fmt(ov.get('floor_fraction'), '.2f')} |"
        + (f" {ov['note']}" if "note" in ov else ""))
  return "\n".join(lines)


def failures(cases):
  """Names of entries that errored or disagreed with their baseline."""
  bad = []
  for case in cases:
    if "error" in case:
      bad.append(f"{case['name']}: case error")
    for rec in case["contestants"]:
      if "error" in rec or rec.get("numerics_ok") is False:
        bad.append(f"{case['name']}: {rec['name']}")
    if case.get("baseline_vs_reference", 0.0) >= TOLERANCE:
      bad.append(f"{case['name']}: baseline vs reference")
  return bad


# ------------------------------------------------------------------ main


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="where to write the JSON results")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes on 2 simulated CPU devices")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  mesh = make_mesh()
  print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}",
        flush=True)
  cases = []
  for idx, cfg in enumerate(smoke_cases() if args.smoke else gpu_cases()):
    cases.append(run_case(mesh, cfg, jax.random.key(idx), args.smoke))
  result = {
      "device": jax.devices()[0].device_kind,
      "n_devices": len(jax.devices()),
      "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "command": "python -m benchmarks.core_check " + " ".join(sys.argv[1:]),
      "cases": cases,
  }
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print("\n" + markdown(cases), flush=True)
  bad = failures(cases)
  if bad:
    print("\n!!! FAILURES:\n  " + "\n  ".join(bad), flush=True)
  print(f"\nwrote {args.out}", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
