"""``python -m jaxmercury.tune``: tune an operator on this machine's devices.

Without GPUs it simulates an 8-device CPU mesh (the pipeline and correctness
are real; the timings are CPU timings)::

  python -m jaxmercury.tune attention --seq_len 256 --heads 8 --kv_heads 2 --causal
  python -m jaxmercury.tune matmul --m 512 --n 512 --k 1024 --mesh node=2,gpu=4 --json out.json
  python -m jaxmercury.tune attention --causal --training      # the fastest forward-and-backward step
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

from absl import flags

from jaxmercury._cpu_flags import cpu_flags

FLAGS = flags.FlagValues()
flags.DEFINE_integer("batch", 1, "attention: batch", flag_values=FLAGS)
flags.DEFINE_integer("heads", 8, "attention: query heads", flag_values=FLAGS)
flags.DEFINE_integer("kv_heads", 8, "attention: key/value heads (GQA when fewer, MQA at 1)", flag_values=FLAGS)
flags.DEFINE_integer("seq_len", 256, "attention: query and key length", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 32, "attention: head dimension", flag_values=FLAGS)
flags.DEFINE_boolean("causal", False, "attention: causal mask", flag_values=FLAGS)
flags.DEFINE_integer("m", 512, "matmul: rows of A and C", flag_values=FLAGS)
flags.DEFINE_integer("n", 256, "matmul: columns of B and C", flag_values=FLAGS)
flags.DEFINE_integer("k", 512, "matmul: the reduction length", flag_values=FLAGS)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "element type", flag_values=FLAGS)
flags.DEFINE_string("mesh", None, "mesh levels, e.g. gpu=2 or node=2,gpu=4 (default: all devices on one level)",
                    flag_values=FLAGS)
flags.DEFINE_string("memory_budget", None, "per-device memory budget, e.g. 40GiB or 512MiB", flag_values=FLAGS)
flags.DEFINE_integer("top", 8, "candidates compiled and timed besides each library strategy with its "
                     "best-predicted kernel, best predicted first", flag_values=FLAGS)
flags.DEFINE_integer("space", 24, "design-space schedules added to the library's", flag_values=FLAGS)
flags.DEFINE_boolean("kernel_variants", False, "also try every tunable variant (block sizes) of each local kernel",
                     flag_values=FLAGS)
flags.DEFINE_integer("iters", 10, "timed runs per candidate", flag_values=FLAGS)
flags.DEFINE_float("time_limit", 300.0, "seconds a candidate may take to compile and run once", flag_values=FLAGS)
flags.DEFINE_enum("isolation", "thread", ["thread", "process"],
                  "thread: measure in this process, abandoning a candidate at --time_limit; process: measure each "
                  "candidate in a worker process that is killed at --time_limit", flag_values=FLAGS)
flags.DEFINE_string("db", None, "tuning database (default ~/.cache/jaxmercury/tuning.db)", flag_values=FLAGS)
flags.DEFINE_boolean("retune", False, "tune even if the database holds a winner", flag_values=FLAGS)
flags.DEFINE_boolean("training", False, "find the fastest training step (forward and backward, gradients checked) "
                     "instead of the fastest forward; kept apart in the database", flag_values=FLAGS)
flags.DEFINE_string("json", None, "write the result as JSON here", flag_values=FLAGS)
flags.DEFINE_string("plot", None, "write the latency-memory scatter (PNG) here", flag_values=FLAGS)
flags.DEFINE_string("predict_mesh", None, "also predict times on this (larger) mesh, e.g. node=4,gpu=4",
                    flag_values=FLAGS)
flags.DEFINE_string("link_gbps", None, "links of --predict_mesh in Gb/s per level, e.g. node=100 "
                    "(levels not named keep this machine's measured links)", flag_values=FLAGS)
flags.DEFINE_integer("cpu_devices", 8, "simulated CPU devices when no GPU is present", flag_values=FLAGS)

_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str) -> int:
  """``"40GiB"`` -> bytes."""
  m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]i?B|B)?\s*", text)
  if not m:
    raise ValueError(f"--memory_budget {text!r}: expected a number and a unit such as 512MiB or 40GiB")
  return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def parse_mesh(text: str | None, n_devices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """``"node=2,gpu=4"`` -> (("node", "gpu"), (2, 4))."""
  if not text:
    return ("gpu",), (n_devices,)
  names, sizes = [], []
  for part in text.split(","):
    name, _, size = (x.strip() for x in part.partition("="))
    if not name.isidentifier() or not size.lstrip("-").isdigit():
      raise ValueError(f"--mesh {text!r}: expected level=size pairs such as gpu=8 or node=2,gpu=4")
    if int(size) < 1:
      raise ValueError(f"--mesh {text!r}: level {name!r} has size {size}; each level needs at least 1 device")
    if name in names:
      raise ValueError(f"--mesh {text!r}: level {name!r} is named twice")
    names.append(name)
    sizes.append(int(size))
  if math.prod(sizes) > n_devices:
    raise ValueError(f"--mesh {text!r} needs {math.prod(sizes)} devices; this machine has {n_devices}")
  return tuple(names), tuple(sizes)


def parse_links(text: str | None) -> dict[str, float]:
  """``"node=100,gpu=900"`` (Gb/s) -> bytes per second per level."""
  out = {}
  for part in (text or "").split(","):
    if part.strip():
      name, _, gbps = part.partition("=")
      try:
        out[name.strip()] = float(gbps) * 1e9 / 8
      except ValueError:
        raise ValueError(f"--link_gbps {text!r}: expected level=Gb/s pairs such as node=100") from None
  return out


def predictions(prog, machine, jm) -> list:
  """Predicted candidates on --predict_mesh, printed as a table."""
  from jax.sharding import AbstractMesh, AxisType  # JAX starts only after main() set XLA_FLAGS
  names, sizes = parse_mesh(FLAGS.predict_mesh, 1 << 30)
  mesh = AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))
  machine = machine.with_links(**parse_links(FLAGS.link_gbps))
  cands = jm.tuner.predict_candidates(prog, mesh, machine, space=FLAGS.space)
  print(f"\npredicted on mesh {dict(mesh.shape)} (links, bytes/s: {machine.link_bytes_per_s}):")
  print("| candidate | predicted ms | memory MiB |\n|---|---|---|")
  for c in cands[:15]:
    print(f"| {c.name} | {c.predicted_ms:.3f} | {c.memory_bytes / 2**20:.2f} |")
  return [{"name": c.name, "schedule": json.loads(c.schedule.to_json()), "predicted_ms": c.predicted_ms,
           "memory_bytes": c.memory_bytes} for c in cands]


OPERATORS = ("attention", "matmul")
USAGE = "usage: python -m jaxmercury.tune {attention,matmul} [flags]   (--help lists the flags)"
HELP = ("-h", "--help", "-help", "--helpfull", "-helpfull", "--helpshort", "-helpshort")
# Flags that must be at least 1 (0 for --top and --space), with the operator they describe (None: every one).
AT_LEAST = {"batch": ("attention", 1), "heads": ("attention", 1), "kv_heads": ("attention", 1),
            "seq_len": ("attention", 1), "head_dim": ("attention", 1), "m": ("matmul", 1), "n": ("matmul", 1),
            "k": ("matmul", 1), "iters": (None, 1), "cpu_devices": (None, 1), "top": (None, 0), "space": (None, 0)}


def check_flags(operator: str):
  """Raises ValueError naming the first flag whose value cannot describe ``operator``'s tune (before JAX starts)."""
  for name, (applies, least) in AT_LEAST.items():
    value = FLAGS[name].value
    if applies in (None, operator) and value < least:
      raise ValueError(f"--{name} {value}: must be at least {least} ({FLAGS[name].help})")
  if operator == "attention" and FLAGS.heads % FLAGS.kv_heads:
    raise ValueError(f"--heads {FLAGS.heads} is not a multiple of --kv_heads {FLAGS.kv_heads}: each key/value head "
                     "serves the same number of query heads")
  if FLAGS.time_limit <= 0:
    raise ValueError(f"--time_limit {FLAGS.time_limit:g}: must be a positive number of seconds")
  if FLAGS.memory_budget is not None:
    parse_bytes(FLAGS.memory_budget)
  parse_links(FLAGS.link_gbps)
  if FLAGS.predict_mesh:
    parse_mesh(FLAGS.predict_mesh, 1 << 30)


def _program(kind, jm):
  if kind == "attention":
    return jm.programs.attention(FLAGS.batch, FLAGS.heads, FLAGS.kv_heads, FLAGS.seq_len, FLAGS.seq_len,
                                 FLAGS.head_dim, causal=FLAGS.causal, dtype=FLAGS.dtype)
  return jm.programs.matmul(FLAGS.m, FLAGS.n, FLAGS.k, dtype=FLAGS.dtype)


WINNER_FIELDS = ("name", "strategy", "origin", "plain", "kernel", "kernel_config", "lowering", "lowering_config",
                 "schedule", "time_ms", "final_ms", "memory_bytes")


def result_json(result, mesh) -> dict:
  """The ``--json`` report: every candidate in its structured form (``Candidate.to_dict``; a plain program, what a
  user would run without jaxmercury, carries ``"plain": true``), the winner's too, the best plain program
  (``"baseline"``: its name and time) and the winner's speedup over it, on the times of the round they were
  compared in (the final round's where both ran in it), how the winner was chosen (``"decision"``), and where the
  tune's time went (``"phases"``: seconds per stage), the cost model's rank agreement (``"spearman"``) and how many
  programs it compiled (``"compiled"``)."""
  def structured(c):
    d = c.to_dict()
    d["schedule"] = json.loads(d["schedule"])
    return d
  cands = [structured(c) for c in result.candidates]
  winner = {k: v for k, v in structured(result.best).items() if k in WINNER_FIELDS} if result.best else None
  base = result.baseline
  baseline = None if base is None else {
      "name": base.name, "time_ms": base.final_ms if base.final_ms is not None and result.best is not None
      and result.best.final_ms is not None else base.time_ms, "own_time_ms": base.time_ms, "final_ms": base.final_ms}
  return {"objective": result.objective, "winner": winner, "baseline": baseline,
          "speedup_vs_baseline": result.speedup_vs_baseline, "decision": result.decision,
          "tied": [c.name for c in result.tied], "phases": result.phases, "spearman": result.spearman,
          "compiled": result.compiled, "candidates": cands,
          "from_database": result.from_database, "device_kind": mesh.devices.flat[0].device_kind,
          "platform": mesh.devices.flat[0].platform, "mesh": dict(mesh.shape)}


def main(argv) -> int:
  if any(arg in HELP for arg in argv[1:]):
    listed = "\n".join(line for line in FLAGS.get_help().splitlines() if not line.endswith(".py:"))
    print(f"{USAGE}\n\n{__doc__.strip()}\n\nflags:\n{listed}")
    return 0
  rest = FLAGS(argv)
  if len(rest) == 1:
    print(USAGE, file=sys.stderr)
    return 2
  if rest[1] not in OPERATORS or len(rest) > 2:
    what = f"unknown operator {rest[1]!r}" if rest[1] not in OPERATORS else f"unexpected arguments {rest[2:]}"
    raise ValueError(f"{what}; the operators are {', '.join(OPERATORS)}")
  check_flags(rest[1])
  os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""), FLAGS.cpu_devices)
  # JAX starts here, after XLA_FLAGS asked for the simulated CPU devices
  import jax
  from jax.sharding import AxisType

  import jaxmercury as jm  # imports JAX: after XLA_FLAGS too

  platform = jax.devices()[0].platform
  names, sizes = parse_mesh(FLAGS.mesh, len(jax.devices()))
  mesh = jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))
  prog = _program(rest[1], jm)
  where = ("simulated CPU mesh: correctness is real, timings are CPU timings" if platform == "cpu"
           else f"{jax.devices()[0].device_kind}")
  print(f"{math.prod(sizes)} devices, mesh {dict(mesh.shape)} ({where})", flush=True)
  db = jm.Database(FLAGS.db)
  budget = parse_bytes(FLAGS.memory_budget) if FLAGS.memory_budget else None
  candidates = None
  if FLAGS.kernel_variants:
    from jaxmercury.kernels import registry  # imports JAX: after XLA_FLAGS
    from jaxmercury.tuner.autotuner import default_candidates  # as above
    candidates = default_candidates(prog, mesh, space=FLAGS.space,
                                    kernels=registry.candidates(prog, mesh, variants=True))
  result = jm.autotune(prog, mesh, candidates=candidates, space=FLAGS.space, top_k=FLAGS.top, memory_budget=budget,
                       iters=FLAGS.iters, time_limit_s=FLAGS.time_limit, database=db, retune=FLAGS.retune,
                       isolation=FLAGS.isolation, training=FLAGS.training,
                       log=lambda s: print(s, flush=True))
  print("\n" + result.table())
  report = result_json(result, mesh)
  if FLAGS.predict_mesh:
    machine = result.machine or db.machine(prog, mesh) or jm.tuner.calibrate.calibrate(prog, mesh)
    report["predictions"] = {"mesh": FLAGS.predict_mesh, "link_gbps": FLAGS.link_gbps,
                             "candidates": predictions(prog, machine, jm)}
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(report, f, indent=1)
  if FLAGS.plot and result.candidates:
    from jaxmercury.tuner.plot import latency_memory_plot  # matplotlib: only for --plot
    latency_memory_plot(result, FLAGS.plot, title=f"{prog.name} on {dict(mesh.shape)} ({platform})")
  if result.best is None:
    print(f"\n{result.summary()}" + ("; raise --memory_budget" if budget is not None and any(
        c.result is not None and c.result.cause == jm.tuner.measure.OVER_BUDGET for c in result.candidates) else ""))
    return 1
  source = "from the database" if result.from_database else "stored in the database"
  print(f"\nwinner: {result.best.name} ({result.best.time_ms:.3f} ms{' on CPU' if platform == 'cpu' else ''}), "
        f"{source} {db.path}\n\n{result.best.schedule}")
  return 0


def run(argv) -> int:
  """``main`` with bad arguments reported as one line (exit status 2), not a traceback; Ctrl-C ends with exit status
  130 after saying how many measurements are kept."""
  try:
    return main(argv)
  except (ValueError, flags.Error) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    kept = getattr(e, "kept", None)
    print(f"\ninterrupted; {kept if kept is not None else 'the'} measurements kept, rerun to resume"
          if kept != 0 else "\ninterrupted; no measurement was taken yet", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)  # not a normal exit: XLA's threads may still be running a computation
  except Exception as e:
    from jaxmercury.errors import ScheduleError  # imports JAX: only once main() set XLA_FLAGS
    if isinstance(e, ScheduleError):
      print(f"error: {e}", file=sys.stderr)
      return 2
    raise


if __name__ == "__main__":
  sys.exit(run(sys.argv))
