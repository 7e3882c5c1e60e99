"""``python -m jaxmercury.tune``: tune an operator on this machine's devices.

Without GPUs it simulates an 8-device CPU mesh (the pipeline and correctness
are real; the timings are CPU timings)::

  python -m jaxmercury.tune attention --seq_len 256 --heads 8 --kv_heads 2 --causal
  python -m jaxmercury.tune matmul --m 512 --n 512 --k 1024 --mesh node=2,gpu=4 --json out.json
  python -m jaxmercury.tune moe --tokens 1024 --experts 8 --top_k 2
  python -m jaxmercury.tune attention --causal --training      # the fastest forward-and-backward step

Each registered operator (``jaxmercury.programs.operators()``) takes a flag per
declared parameter; the tuning options are common to every operator.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
import textwrap

from jaxmercury._cpu_flags import cpu_flags
from jaxmercury.programs import Operator, Param, find_operator, operators

PROG = "python -m jaxmercury.tune"
HELP = ("-h", "--help", "-help", "--helpfull", "-helpfull", "--helpshort", "-helpshort")
USAGE = f"usage: {PROG} OPERATOR [flags]   ({PROG} --help lists the operators and their flags)"

# The tuning options, common to every operator: the one place they are declared (``tune_kwargs`` maps them onto
# ``autotune``'s keywords).
TUNING = (
    Param(name="mesh", default=None, kind=str,
          help="mesh levels, outermost first, e.g. gpu=2 or node=2,gpu=4 (default: all devices on one level gpu)"),
    Param(name="cpu_devices", default=8, minimum=1, help="simulated CPU devices when no GPU is present"),
    Param(name="memory_budget", default=None, kind=str, help="per-device memory budget, e.g. 40GiB or 512MiB"),
    Param(name="space", default=24, minimum=0, help="design-space schedules added to the library's"),
    Param(name="kernel_variants", default=False,
          help="also try every tunable variant (block sizes) of each local kernel"),
    Param(name="top", default=8, minimum=0, help="candidates compiled and timed besides each library strategy with "
          "its best-predicted kernel, best predicted first"),
    Param(name="iters", default=10, minimum=1, help="timed runs per candidate"),
    Param(name="time_limit", default=300.0, help="seconds a candidate may take to compile and run once"),
    Param(name="isolation", default="thread", choices=("thread", "process"),
          help="thread: measure in this process, abandoning a candidate at --time_limit; process: measure each "
               "candidate in a worker process that is killed at --time_limit"),
    Param(name="db", default=None, kind=str, help="tuning database (default ~/.cache/jaxmercury/tuning.db)"),
    Param(name="retune", default=False, help="tune even if the database holds a winner"),
    Param(name="training", default=False, help="find the fastest training step (forward and backward, gradients "
          "checked) instead of the fastest forward; kept apart in the database"),
    Param(name="json", default=None, kind=str, help="write the result as JSON here"),
    Param(name="plot", default=None, kind=str, help="write the latency-memory scatter (PNG) here"),
    Param(name="predict_mesh", default=None, kind=str,
          help="also predict times on this (larger) mesh, e.g. node=4,gpu=4"),
    Param(name="link_gbps", default=None, kind=str, help="links of --predict_mesh in Gb/s per level, e.g. node=100 "
          "(levels not named keep this machine's measured links)"),
)

_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str) -> int:
  """``"40GiB"`` -> bytes."""
  m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]i?B|B)?\s*", text)
  if not m:
    raise ValueError(f"--memory_budget {text!r}: expected a number and a unit such as 512MiB or 40GiB")
  return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def parse_mesh(text: str | None, n_devices: int, flag: str = "mesh") -> tuple[tuple[str, ...], tuple[int, ...]]:
  """``"node=2,gpu=4"`` -> (("node", "gpu"), (2, 4)); errors name ``--flag``."""
  if not text:
    return ("gpu",), (n_devices,)
  names, sizes = [], []
  for part in text.split(","):
    name, _, size = (x.strip() for x in part.partition("="))
    if not name.isidentifier() or not size.lstrip("-").isdigit():
      raise ValueError(f"--{flag} {text!r}: expected level=size pairs such as gpu=8 or node=2,gpu=4")
    if int(size) < 1:
      raise ValueError(f"--{flag} {text!r}: level {name!r} has size {size}; each level needs at least 1 device")
    if name in names:
      raise ValueError(f"--{flag} {text!r}: level {name!r} is named twice")
    names.append(name)
    sizes.append(int(size))
  if math.prod(sizes) > n_devices:
    raise ValueError(f"--{flag} {text!r} needs {math.prod(sizes)} devices; this machine has {n_devices}")
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


def predictions(prog, machine, jm, options: dict) -> list:
  """Predicted candidates on --predict_mesh, printed as a table."""
  from jax.sharding import AbstractMesh, AxisType  # JAX's devices start only after main() set XLA_FLAGS
  names, sizes = parse_mesh(options["predict_mesh"], 1 << 30, flag="predict_mesh")
  mesh = AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))
  machine = machine.with_links(**parse_links(options["link_gbps"]))
  cands = jm.tuner.predict_candidates(prog, mesh, machine, space=options["space"])
  print(f"\npredicted on mesh {dict(mesh.shape)} (links, bytes/s: {machine.link_bytes_per_s}):")
  print("| candidate | predicted ms | memory MiB |\n|---|---|---|")
  for c in cands[:15]:
    print(f"| {c.name} | {c.predicted_ms:.3f} | {c.memory_bytes / 2**20:.2f} |")
  return [{"name": c.name, "schedule": json.loads(c.schedule.to_json()), "predicted_ms": c.predicted_ms,
           "memory_bytes": c.memory_bytes} for c in cands]



def tune_kwargs(options: dict) -> dict:
  """The tuning options as ``jm.autotune``'s keywords."""
  budget = options["memory_budget"]
  return dict(space=options["space"], top_k=options["top"], iters=options["iters"],
              time_limit_s=options["time_limit"], retune=options["retune"], isolation=options["isolation"],
              training=options["training"], memory_budget=parse_bytes(budget) if budget else None)


def check_options(options: dict):
  """Raises ValueError naming the first tuning option whose value is not valid (before JAX starts)."""
  if options["time_limit"] <= 0:
    raise ValueError(f"--time_limit {options['time_limit']:g}: must be a positive number of seconds")
  if options["memory_budget"] is not None:
    parse_bytes(options["memory_budget"])
  parse_links(options["link_gbps"])
  for name in ("mesh", "predict_mesh"):
    if options[name] is not None:
      parse_mesh(options[name], 1 << 30, flag=name)


# ----------------------------------------------------------------------------- flags from the declarations

_KIND = {int: "INT", float: "NUMBER", str: "TEXT"}
_COLUMN, _WIDTH = 30, 118  # --help: where the flags' help starts, and the lines' width
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _value(param: Param, text: str):
  """The value of ``--name text``; ValueError naming the flag and what would be valid."""
  try:
    if param.kind is bool:
      if text.lower() not in _TRUE + _FALSE:
        raise ValueError
      value = text.lower() in _TRUE
    else:
      value = param.kind(text)
  except ValueError:
    want = {int: "an integer", float: "a number", bool: "true or false"}[param.kind]
    raise ValueError(f"--{param.name} {text!r}: expected {want} ({param.help})") from None
  if why := param.problem(value):
    raise ValueError(f"--{param.name} {text}: {why} ({param.help})")
  return value


def _unknown(name: str, operator: Operator) -> ValueError:
  """The error for ``--name``, which ``operator`` does not take: whose flag it is, or the nearest of its own."""
  own = [p.name for p in operator.params + TUNING]
  bare = name[2:] if name.startswith("no") else name  # --nocausal: a switch's other spelling
  other = [op.name for op in operators() if op is not operator and {name, bare} & {p.name for p in op.params}]
  if other:
    hint = f"it is a flag of {', '.join(other)}"
  elif near := difflib.get_close_matches(name, own, n=1):
    hint = f"did you mean --{near[0]}?"
  else:
    hint = f"`{PROG} {operator.name} --help` lists its flags"
  return ValueError(f"unknown flag --{name} for {operator.name}: {hint}")


def parse_args(args: list[str]) -> tuple[Operator, dict, dict]:
  """``OPERATOR [flags]`` -> (the operator, its parameters' values, the tuning options).

  Flags are ``--name value`` or ``--name=value``; a switch is ``--name`` or ``--noname``. Values are checked
  against their declarations: ValueError names the flag and what would be valid.
  """
  operator = find_operator(args[0])
  params = {p.name: p for p in operator.params + TUNING}
  values = {p.name: p.default for p in params.values()}
  rest, extra = list(args[1:]), []
  while rest:
    token = rest.pop(0)
    if not token.startswith("-") or token.strip("-") == "":
      extra.append(token)
      continue
    name, given, text = token.lstrip("-").partition("=")
    switch = name[2:] if name.startswith("no") and not given else None
    if name not in params and switch in params and params[switch].kind is bool:
      values[switch] = False
      continue
    if name not in params:
      raise _unknown(name, operator)
    if params[name].kind is bool and not given:
      values[name] = True
      continue
    if not given:
      if not rest or rest[0].startswith("--"):
        raise ValueError(f"--{name} needs a value ({params[name].help})")
      text = rest.pop(0)
    values[name] = _value(params[name], text)
  if extra:
    raise ValueError(f"unexpected arguments {extra}; {operator.name} takes flags only")
  own = {p.name for p in operator.params}
  return (operator, {k: v for k, v in values.items() if k in own},
          {k: v for k, v in values.items() if k not in own})


def _flag_lines(params) -> list[str]:
  lines = []
  for p in params:
    if p.kind is bool:
      flag = f"--[no]{p.name}"
    else:
      flag = f"--{p.name} {'{' + ','.join(p.choices) + '}' if p.choices else _KIND[p.kind]}"
    notes = [f"default {str(p.default).lower() if p.kind is bool else p.default}"] if p.default is not None else []
    notes += [f"at least {p.minimum}"] if p.minimum is not None else []
    text = p.help + (f" ({'; '.join(notes)})" if notes else "")
    if len(flag) > _COLUMN - 3:  # the help under its flag
      lines.append(f"  {flag}")
      flag = ""
    lines.append(textwrap.fill(text, _WIDTH, initial_indent=f"  {flag:<{_COLUMN - 3}} ",
                               subsequent_indent=" " * _COLUMN))
  return lines


def help_text(operator: Operator | None = None) -> str:
  """``--help``: the usage, the examples and every operator's flags (or ``operator``'s), then the tuning options."""
  shown = operators() if operator is None else (operator,)
  usage = USAGE if operator is None else f"usage: {PROG} {operator.name} [flags]"
  about = __doc__.strip().split("\n\n", 1)[1].replace("``", "").replace("::", ":")
  parts = [usage, "" if operator else "\n" + about]
  for op in shown:
    parts += [f"\n{op.name}: {op.summary}", *_flag_lines(op.params)]
  parts += ["\ntuning options (every operator):", *_flag_lines(TUNING)]
  return "\n".join(p for p in parts if p)


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
  """``argv`` as ``sys.argv``: the program name, the operator, its flags and the tuning options. Returns the exit
  status (0: a winner; 1: nothing passed; 2: no operator)."""
  if any(arg in HELP for arg in argv[1:]):
    named = argv[1] if argv[1] not in HELP else None
    print(help_text(find_operator(named) if named else None))
    return 0
  if len(argv) < 2:
    print(USAGE, file=sys.stderr)
    return 2
  operator, values, options = parse_args(argv[1:])
  check_options(options)
  prog = operator.program(**values)  # the operator's own checks, before any work
  os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""), options["cpu_devices"])
  # JAX's devices start here, after XLA_FLAGS asked for the simulated CPU devices
  import jax
  from jax.sharding import AxisType

  import jaxmercury as jm  # the package: jaxmercury.programs imported it already

  platform = jax.devices()[0].platform
  names, sizes = parse_mesh(options["mesh"], len(jax.devices()))
  mesh = jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))
  where = ("simulated CPU mesh: correctness is real, timings are CPU timings" if platform == "cpu"
           else f"{jax.devices()[0].device_kind}")
  print(f"{math.prod(sizes)} devices, mesh {dict(mesh.shape)} ({where})", flush=True)
  db = jm.Database(options["db"])
  kwargs = tune_kwargs(options)
  candidates = None
  if options["kernel_variants"]:
    from jaxmercury.kernels import registry  # only for --kernel_variants
    from jaxmercury.tuner.autotuner import default_candidates  # as above
    candidates = default_candidates(prog, mesh, space=options["space"],
                                    kernels=registry.candidates(prog, mesh, variants=True))
  result = jm.autotune(prog, mesh, candidates=candidates, database=db, log=lambda s: print(s, flush=True), **kwargs)
  print("\n" + result.table())
  report = result_json(result, mesh)
  if options["predict_mesh"]:
    machine = result.machine or db.machine(prog, mesh) or jm.tuner.calibrate.calibrate(prog, mesh)
    report["predictions"] = {"mesh": options["predict_mesh"], "link_gbps": options["link_gbps"],
                             "candidates": predictions(prog, machine, jm, options)}
  if options["json"]:
    with open(options["json"], "w") as f:
      json.dump(report, f, indent=1)
  if options["plot"] and result.candidates:
    from jaxmercury.tuner.plot import latency_memory_plot  # matplotlib: only for --plot
    latency_memory_plot(result, options["plot"], title=f"{prog.name} on {dict(mesh.shape)} ({platform})")
  if result.best is None:
    budget = kwargs["memory_budget"]
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
  except ValueError as e:  # the errors of jaxmercury.errors too: each a ValueError
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    kept = getattr(e, "kept", None)
    print(f"\ninterrupted; {kept if kept is not None else 'the'} measurements kept, rerun to resume"
          if kept != 0 else "\ninterrupted; no measurement was taken yet", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)  # not a normal exit: XLA's threads may still be running a computation


if __name__ == "__main__":
  sys.exit(run(sys.argv))
