"""The operator suites: jaxmercury against every plain-JAX baseline, side by side on the same inputs and devices.

* ``attention``, ``gemm``: jaxmercury's operator tuned by ``jm.autotune`` for the callers' layouts (attention:
  q, k, v and o sequence-sharded over every mesh level; all-gather GEMM: x row-sharded, w and the output
  column-sharded; reduce-scatter GEMM: x column-sharded, w and the output row-sharded) against every baseline
  (``benchmarks.baselines``), with the physical floor: the larger of one rank's share of the compute timed on one
  device and the fewest bytes a device must receive at the ring bandwidth measured on the mesh. XLA's automatic
  collective matmul needs XLA flags read once, when JAX starts, that would change every other contestant too: a
  child process runs it (``xla_auto_windowed``, checked there against a ``shard_map`` reference).
* ``training``: the same for a training step (forward and the gradients of every input for a random cotangent,
  ``measure.training_step``), jaxmercury tuned with ``training=True``.
* ``fused``: every registered fused kernel of the case's placement kind (``Schedule.lower_with``, at its
  defaults) against the library schedule it lowers (its ordinary ``shard_map`` lowering, a baseline here) and the
  baselines; ``--training`` times their training steps, each kernel also with every other backward it offers.

A contestant that fails at one size is skipped at the larger sizes of its family. ``--smoke`` adds the program's
own reference on one device, which every contestant is checked against.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
import zlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from benchmarks import cases, harness
from benchmarks.baselines import WINDOWED_EINSUM_FLAGS, gemm
from benchmarks.baselines import attention as attn
from benchmarks.cases import size_label
from jaxmercury.analysis import placements
from jaxmercury.errors import PreconditionError
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import registry
from jaxmercury.kernels.placements import ALLGATHER, REDUCESCATTER, RING_ATTENTION
from jaxmercury.tuner import measure
from jaxmercury.tuner.autotuner import lowering_variants
from jaxmercury.tuner.calibrate import calibrate
from jaxmercury.tuner.cost import Machine
from jaxmercury.tuner.database import FORWARD, TRAINING
from jaxmercury.tuner.plain import runnable_from_json
from jaxmercury.tuner.plot import latency_memory_plot

# The cost model's figures on the simulated CPU mesh of --smoke (calibrating takes ~30 s there).
SMOKE_MACHINE = Machine(name="simulated CPU (fixed figures, not calibrated)", flops_per_s=2e10,
                        link_bytes_per_s={"*": 2e8}, latency_s=1e-4, kernel_flops_per_s={"xla": 2e10},
                        call_overhead_s=1e-4, memory_bytes_per_s=1e10)
# The library schedules the fused suite lowers, per placement kind.
FUSED_STRATEGIES = {ALLGATHER: ("async_tp",), REDUCESCATTER: ("async_tp_reducescatter",),
                    RING_ATTENTION: ("ring", "ring_zigzag")}


class Env:
  """What the cases of one run share: flags, meshes, measured links and cost-model figures, the sweep's memory."""

  def __init__(self, args, results: dict, deadline: float):
    self.args, self.results, self.deadline = args, results, deadline
    self.training = args.suite == "training" or args.training
    self.impl = "xla" if args.smoke else "cudnn"
    tunes = args.suite in ("attention", "gemm", "training") and not args.windowed_child
    self.database = jm.Database(args.db) if tunes else None
    self.meshes = {}
    self.winners = {}  # family -> (flops, trace, strategy fields) of the sweep's last tuned winner
    self.failed = {}  # family -> {contestant: why}: failed at a smaller size, skipped at the larger ones
    self.windowed = {}  # case name -> the windowed-einsum child's record (``run`` fills it)

  def mesh(self, spec: str):
    if spec not in self.meshes:
      self.meshes[spec] = harness.make_mesh(spec)
    return self.meshes[spec]

  def link(self, mesh) -> dict | None:
    """The ppermute ring bandwidth over the whole mesh, measured once per mesh."""
    key = "x".join(map(str, mesh.devices.shape))
    links = self.results.setdefault("links", {})
    if key not in links:
      try:
        links[key] = harness.link_bandwidth(mesh, (4 if self.args.smoke else 1024) << 20)
      except Exception as exc:  # no floor then
        links[key] = {"error": harness.error_text(exc)}
    return links[key] if "bytes_per_s" in links[key] else None

  def machine(self, prog, mesh, size: int) -> Machine:
    """Fixed figures on the smoke mesh; else calibrated once per pattern and mesh (again for a case of 8x the work,
    ``size`` its flops), kept in the results file so that ``--resume`` reuses them."""
    if self.args.smoke:
      return SMOKE_MACHINE
    key = f"{prog.pattern}{' causal' if prog.params.get('causal') else ''} mesh {dict(mesh.shape)}"
    held = self.results.setdefault("machines", {}).get(key)
    if held is None or size >= 8 * held["size"]:
      t0 = time.perf_counter()
      figures = calibrate(prog, mesh).to_dict()
      held = self.results["machines"][key] = {"size": size, "figures": figures,
                                              "calibration_s": round(time.perf_counter() - t0, 2)}
    return Machine.from_dict(held["figures"])


def program(case):
  dtype = jnp.dtype(case.dtype)
  if case.op == "attention":
    return jm.programs.attention(case.batch, case.heads, case.kv_heads, case.seq, case.seq, case.head_dim,
                                 causal=case.causal, dtype=dtype)
  return jm.programs.matmul(case.m, case.n, case.k, dtype=dtype)


def axis(mesh):
  """The mesh's levels as one ``shard_map`` axis: a name, or a tuple (major first)."""
  return mesh.axis_names[0] if len(mesh.axis_names) == 1 else tuple(mesh.axis_names)


def layouts(case, mesh) -> tuple[tuple, P]:
  """The callers' layouts: ``(input specs, output spec)``."""
  if case.op == "attention":
    spec = attn.seq_spec(mesh.axis_names)
    return (spec,) * 3, spec
  x, w, out = gemm.layouts(case.kind, axis(mesh))
  return (x, w), out


def case_key(seed: int, name: str):
  """The PRNG key of a case's inputs: the same in every process for the same seed and case."""
  return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()))


# ------------------------------------------------------------------ contestants


def baselines(env, case, mesh) -> list[harness.Contestant]:
  """The plain-JAX baselines of the case (``benchmarks.baselines``), each with why it cannot run, if it cannot."""
  C, impl, ax = harness.Contestant, env.impl, axis(mesh)
  if case.op == "gemm":
    first = ("allgather_dot", gemm.allgather_dot, "shard_map: all_gather(x) then dot") if case.kind == "allgather" \
        else ("dot_psum_scatter", gemm.dot_psum_scatter, "shard_map: dot then psum_scatter")
    out = [C(first[0], "baseline", lambda: first[1](mesh, ax), first[2]),
           C("xla_auto", "baseline", lambda: gemm.xla_auto(mesh, ax, case.kind), "jit of a sharded dot: XLA's SPMD")]
    if case.kind == "allgather":
      why = gemm.pallas_unavailable(mesh, case.dtype)
      out += [C(f"pallas_mgpu[{'/'.join(map(str, c))}]", "baseline",
                lambda c=c: gemm.pallas_allgather_matmul(mesh, ax, c, jnp.dtype(case.dtype)),
                f"JAX's Mosaic GPU all_gather_lhs_matmul at tiles {c}", skip=why) for c in gemm.PALLAS_CONFIGS]
    return out
  levels, causal, h, kv = tuple(mesh.axis_names), case.causal, case.heads, case.kv_heads
  ulysses_why = attn.heads_problem(h, kv, mesh.devices.size)
  usp_why = ("USP needs a two-level mesh (run with --mesh AxB)" if len(levels) != 2
             else attn.heads_problem(h, kv, mesh.shape[levels[1]]))
  return [C("cp_allgather", "baseline", lambda: attn.context_parallel(mesh, levels, causal=causal, impl=impl),
            f"context parallel: all-gathered K/V + {impl}"),
          C("ring", "baseline", lambda: attn.ring(mesh, levels, causal=causal, impl=impl),
            f"RingAttention: K/V ppermute ring + {impl}"),
          C("ulysses", "baseline", lambda: attn.ulysses(mesh, levels, causal=causal, impl=impl, heads=h, kv_heads=kv),
            f"DeepSpeed-Ulysses: all-to-all + {impl}", skip=ulysses_why and f"ulysses: {ulysses_why}"),
          C("usp", "baseline", lambda: attn.usp(mesh, levels, causal=causal, impl=impl, heads=h, kv_heads=kv),
            f"USP: Ulysses over {levels[-1]}, ring over {levels[0]} + {impl}", skip=usp_why)]


def fields(schedule) -> dict:
  """A schedule's kernel, fused kernel and their configurations, as data."""
  return {"kernel": schedule.kernel, "kernel_config": configs.changed(schedule.kernel_config),
          "lowering": schedule.lowering, "lowering_config": configs.changed(schedule.lowering_config)}


def fused(env, case, prog, mesh, ins, out) -> list[harness.Contestant]:
  """The library schedules of the case's placement kind, each as lowered ordinarily (a baseline here: the unfused
  program, its blocks on the default local kernel) and with every fused kernel of that kind."""
  kind = RING_ATTENTION if case.op == "attention" else case.kind
  strategies = FUSED_STRATEGIES[kind] if case.op == "gemm" or case.causal else ("ring",)  # zigzag: causal balance
  lib, default, result = jm.library(prog, mesh), registry.default_kernel(prog, mesh), []
  chosen = env.args.fused_kernels
  kernels = [k for k in registry.fused_kernels() if k.placement == kind and (not chosen or k.name in chosen)]
  for strategy in strategies:
    base = lib[strategy].with_layouts(ins, out)
    ordinary = base.copy().patch(default) if default else base
    result.append(harness.Contestant(strategy, "baseline", lambda s=ordinary: s.compile(),
                                     f"jaxmercury {strategy}, ordinary shard_map lowering",
                                     record={"strategy": strategy, **fields(ordinary)}))
    for k in kernels:
      why = placements.why_not(k, base)
      for params in fused_variants(k, mesh, env):
        lowered, skip = None, why
        if not why:
          try:
            lowered = base.copy().lower_with(k.name, **params)
          except PreconditionError as exc:  # these parameters do not fit the case (the kernel's own reason)
            skip = str(exc)
        label = " ".join([k.name, *(f"{key}={value}" for key, value in params.items())])
        result.append(harness.Contestant(
            f"{strategy} {{{label}}}", "jaxmercury", lambda s=lowered: s.compile(),
            k.description, skip=skip, record={"strategy": strategy, "lowering": k.name, "lowering_config": params}))
  return result


def fused_variants(kernel, mesh, env) -> list[dict]:
  """The parameters ``kernel`` is timed at: the tuner's (``lowering_variants``: in training each backward it
  offers), then each of those with every ``--fused_params`` set whose fields its configuration has."""
  variants = lowering_variants(kernel.name, mesh, env.training)
  fields = configs.choices(kernel.config) if kernel.config is not None else {}
  extras = [extra for extra in env.args.fused_params or () if set(extra) <= set(fields)]
  return variants + [{**v, **extra} for extra in extras for v in variants]


def tuned(env, case, prog, mesh, ins, out, rec: dict) -> harness.Contestant:
  """jaxmercury's contestant: ``jm.autotune``'s winner for the callers' layouts (``rec["tuner"]`` says how it went).

  When one call does more than ``--tune_max_tflop`` per device, or the tuner fails (it builds its inputs and
  reference on one device: out of memory), the sweep's last winner, tuned at a smaller size, is replayed on this
  size instead (``replayed``).
  """
  name, args = "jaxmercury", env.args
  if why := env.failed.get(case.family, {}).get(name):
    return harness.Contestant(name, "jaxmercury", None, skip=why)
  tuner, schedule, record = rec.setdefault("tuner", {}), None, {}
  if prog.flops / mesh.devices.size > args.tune_max_tflop * 1e12 and case.family in env.winners:
    tuner["not_tuned"] = f"above --tune_max_tflop {args.tune_max_tflop:g} TFLOP per device"
  else:
    t0, limit = time.perf_counter(), max(10.0, min(args.candidate_time_limit, env.deadline - time.time()))
    try:
      result = jm.autotune(prog, mesh, in_shardings=ins, out_sharding=out, top_k=args.top_k, space=args.space,
                           iters=args.tune_iters, time_limit_s=limit, machine=env.machine(prog, mesh, case.flops),
                           database=env.database, key=jax.random.key(args.seed), training=env.training,
                           log=lambda s: harness.log("    " + s))
      tuner.update(wall_s=round(time.perf_counter() - t0, 2), from_database=result.from_database, candidates=[
          {k: v for k, v in c.to_dict().items() if k != "schedule"} for c in result.candidates])
      failed = [c for c in result.candidates if c.status == measure.FAILED]
      if result.best is not None:
        schedule, record = result.best.schedule, {"strategy": result.best.strategy, "origin": result.best.origin}
        tuner.update(winner=result.best.name, winner_ms=result.best.time_ms, winner_trace=schedule.to_json())
        env.winners[case.family] = (case.flops, tuner["winner_trace"], record)
        plot(env, result, case, tuner)
      elif failed and limit < args.candidate_time_limit and all(
          c.result.reason.startswith("time-out") for c in failed):  # the budget's cut limit: --resume retries
        env.database.clear_measurements(prog, mesh, (ins, out), objective=TRAINING if env.training else FORWARD)
        return harness.Contestant(name, "jaxmercury", None, skip=harness.OUT_OF_TIME, record={"out_of_time": True})
      else:
        tuner["error"] = "no candidate passed: " + "; ".join(sorted({c.result.reason for c in failed}))[:300]
    except Exception as exc:  # the tuner failing is jaxmercury failing: replay the last winner
      tuner["error"] = harness.error_text(exc)
  if schedule is None and case.family in env.winners:
    try:
      _, trace, record = env.winners[case.family]
      schedule = runnable_from_json(prog, mesh, trace, other_sizes=True)  # a schedule or a plain program
      tuner["replayed"] = "the sweep's last winner, tuned at a smaller size"
    except Exception as exc:  # the last winner does not fit this size
      tuner["replay_error"] = harness.error_text(exc)
  if schedule is None:
    return harness.Contestant(name, "jaxmercury", _raiser(f"tuner: {tuner.get('error', 'no winner')}"))
  return harness.Contestant(name, "jaxmercury", lambda: schedule.compile(differentiable=env.training),
                            f"jaxmercury autotune winner: {tuner.get('winner', 'replayed')}",
                            record={**record, **fields(schedule)})


def plot(env, result, case, tuner: dict):
  """The tuner's latency-memory scatter of the case (Mercury's Fig. 13) into ``--plots``."""
  if env.args.plots:
    os.makedirs(env.args.plots, exist_ok=True)
    path = os.path.join(env.args.plots, re.sub(r"[^A-Za-z0-9]+", "-", case.name).strip("-").lower() + ".png")
    tuner["plot"] = latency_memory_plot(result, path, title=f"jaxmercury autotune: {case.name}")


def _raiser(text: str):
  def build():
    raise RuntimeError(text)
  return build


def reference(prog, inputs, training: bool) -> harness.Contestant:
  """The program's own reference on one device (no partitioning, whatever XLA's flags): what ``--smoke`` checks
  every contestant against."""
  fn = measure.training_step(prog.reference) if training else jax.jit(prog.reference)
  one = jax.devices()[0]
  return harness.Contestant("program_reference", "reference", lambda: (fn, [jax.device_put(x, one) for x in inputs]),
                            "the program's reference on one device")


# ------------------------------------------------------------------ floors


def floor(env, case, prog, mesh) -> dict:
  """Compute: one rank's share of the work timed alone on one device (attention: its queries against every key,
  non-causal, at the rate reached there); communication: the fewest bytes a device receives under the baselines'
  strategies, at the measured ring bandwidth."""
  n, dtype, device = mesh.devices.size, jnp.dtype(case.dtype), mesh.devices.flat[0]
  if case.op == "attention":
    b, h, kv, d, s = case.batch, case.heads, case.kv_heads, case.head_dim, case.seq
    fn = attn.local_share(env.impl)
    # one rank's queries against every key, or (where that does not fit one device) against one rank's keys
    shares = [[(b, s // n, h, d), (b, keys, kv, d), (b, keys, kv, d)] for keys in (s, s // n)]
    tokens = b * s * d * dtype.itemsize  # bytes of one head over the whole sequence
    comm = {"K/V all-gather (context parallel, ring)": 2 * (n - 1) / n * tokens * kv}
    if attn.heads_problem(h, kv, n) is None:
      comm["q, k, v, o all-to-all (Ulysses)"] = (n - 1) / n * tokens * (2 * h + 2 * max(kv, n)) / n
  else:
    fn = gemm.local_share
    shares = [[(case.m, case.k), (case.k, case.n // n)] if case.kind == "allgather" else
              [(case.m, case.k // n), (case.k // n, case.n)]]
    comm = {"all-gather of x" if case.kind == "allgather" else "reduce-scatter of the output":
            (n - 1) / n * case.m * (case.k if case.kind == "allgather" else case.n) * dtype.itemsize}
  compute_ms, how = None, ""
  for shapes in shares:
    share = (4.0 if case.op == "attention" else 2.0) * math.prod(shapes[0]) * shapes[1][1]  # its flops
    keys = jax.random.split(case_key(env.args.seed + 1, case.name), len(shapes))
    try:
      xs = [harness.random_array(k, shape, dtype, jax.sharding.SingleDeviceSharding(device))
            for k, shape in zip(keys, shapes)]
      ms = harness.time_call(fn, xs, iters=20, stat=min)
      compute_ms = ms * (prog.flops / n) / share  # this device's work at the share's rate
      how = f"{shapes} on one device: {ms:.3f} ms, {share / ms / 1e9:.1f} TFLOP/s; this device's work at that rate"
      break
    except Exception as exc:  # try the smaller share
      how = f"{shapes}: {harness.error_text(exc)}"
  comm_how = min(comm, key=comm.get)
  return harness.floor_record(compute_ms=compute_ms, compute_how=how, comm_bytes=comm[comm_how],
                              link=env.link(mesh), comm_how=comm_how)


# ------------------------------------------------------------------ one case


def run_case(env, case) -> dict:
  """Every contestant of ``case`` checked and timed side by side; the case's record."""
  mesh, prog, args = env.mesh(case.mesh), program(case), env.args
  ins, out = layouts(case, mesh)
  n = mesh.devices.size
  rec = {"name": case.name, "op": case.op, "family": case.family, "config": dataclasses.asdict(case),
         "mesh": dict(mesh.shape), "training": env.training}
  if args.windowed_child:
    label = f"jit of a sharded dot: XLA partitions, XLA_FLAGS += {WINDOWED_EINSUM_FLAGS}"
    contestants = baselines(env, case, mesh)[:1] + [harness.Contestant(
        "xla_auto_windowed", "baseline", lambda: gemm.xla_auto(mesh, axis(mesh), case.kind), label,
        record={"process": "separate"})]
    contestants[0].role = "reference"
  elif args.suite == "fused":
    contestants = baselines(env, case, mesh) + fused(env, case, prog, mesh, ins, out)
  else:
    contestants = baselines(env, case, mesh) + [tuned(env, case, prog, mesh, ins, out, rec)]
  for c in contestants:
    c.skip = c.skip or env.failed.get(case.family, {}).get(c.name)
  keys = jax.random.split(case_key(args.seed, case.name), len(prog.reads) + 1)
  inputs = [harness.random_array(k, b.shape, b.dtype, NamedSharding(mesh, spec))
            for k, b, spec in zip(keys, prog.reads, ins)]
  if env.training:  # the output's cotangent
    inputs.append(harness.random_array(keys[-1], prog.writes.shape, prog.writes.dtype, NamedSharding(mesh, out)))
    for c in contestants:
      if c.build is not None:
        c.build = lambda build=c.build: measure.training_step(build())
  if args.smoke:
    contestants.insert(0, reference(prog, inputs, env.training))
  work = prog.flops * ((3.0 if case.op == "gemm" else 3.5) if env.training else 1.0) / n
  floor_ms = None
  if not env.training and not args.windowed_child:
    rec["floor"] = floor(env, case, prog, mesh)
    floor_ms = rec["floor"].get("floor_ms")
  settings = harness.Settings.from_args(
      args, env.deadline, measure.gradient_tolerance(case.dtype) if env.training else harness.BF16_TOLERANCE)
  records, ref = harness.run_contestants(contestants, inputs, settings)
  del inputs
  if args.suite == "gemm" and not args.windowed_child:
    records.append(env.windowed.get(case.name) or {
        "name": "xla_auto_windowed", "role": "baseline",
        "skipped": "not run by the windowed-einsum child (--no_windowed, or its time budget)"})
  for r in records:
    if "error" in r:
      size = size_label(case.seq if case.op == "attention" else case.m)
      env.failed.setdefault(case.family, {})[r["name"]] = f"failed at size {size}: {r['error'][:200]}"
  jax.clear_caches()
  return harness.finish(rec, records, ref, floor_ms=floor_ms, flops_per_device=work)


def plan(args) -> list:
  return cases.smoke_plan(args.suite) if args.smoke else cases.plan(cases.options(args))
