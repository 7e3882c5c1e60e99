"""Each GPU kernel's time inside calls that run back to back: the profiler's trace read per call.

``traced(calls, rounds)`` runs the calls in rotating rounds (``measure.rounds``, as the benchmarks time them) under
``jax.profiler.trace``, each call inside a host annotation ``"kernel_trace:<name>:<round>"``, and reads the trace's
Perfetto JSON: per name, the median wall time of a call, its kernels' span on the GPU, the GPU's busy time in that
span (the union of the kernels' intervals) and each kernel's median time per call. On several GPUs only one's
kernels count (``device``); on the CPU there are no GPU lines and only wall times come back.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import jax

from jaxmercury.tuner import measure

CALL = "kernel_trace:"  # the host annotation of one call: "kernel_trace:<name>:<round>"
TOP = 25  # kernels listed per call by name (the rest summed as "other")


def _gpu_processes(trace: dict, device: int | None = None) -> tuple[list, dict]:
  """The trace's events and ``{pid: name}`` of its GPU processes (only GPU ``device``'s, if given)."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid: name for pid, name in names.items() if "GPU" in name or "gpu" in name}
  if device is not None:
    gpu = {pid: name for pid, name in gpu.items() if (m := re.search(r"(\d+)\s*$", name)) and int(m[1]) == device}
  return events, gpu


def _gpu_threads(events, gpu: dict) -> dict:
  """``{(pid, tid): name}`` of the GPU processes' lines."""
  return {(e["pid"], e["tid"]): e["args"]["name"] for e in events
          if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpu}


def gpu_lines(trace: dict) -> list[str]:
  """The names of the trace's GPU processes and their lines (threads): what ``kernels_by_call`` reads."""
  events, gpu = _gpu_processes(trace)
  return sorted(f"{gpu[pid]}: {name}" for (pid, _), name in _gpu_threads(events, gpu).items())


def kernels_by_call(trace: dict, device: int | None = None) -> dict[tuple[str, int], dict]:
  """``(name, round) -> {"wall": us, "kernels": [(kernel, start us, duration us)]}`` from a Perfetto JSON trace:
  each call's host annotation, and the GPU kernels that started inside it (on GPU ``device`` only, if given)."""
  events, gpu = _gpu_processes(trace, device)
  streams = {key for key, name in _gpu_threads(events, gpu).items() if "Stream" in name}  # not XLA Ops lines
  calls = {}
  for e in events:
    if e.get("ph") == "X" and e.get("name", "").startswith(CALL) and e["pid"] not in gpu:
      name, r = e["name"].removeprefix(CALL).rsplit(":", 1)
      calls[(name, int(r))] = {"start": e["ts"], "wall": e["dur"], "kernels": []}
  windows = sorted((c["start"], c["start"] + c["wall"], key) for key, c in calls.items())
  for e in events:
    if e.get("ph") != "X" or e["pid"] not in gpu or (streams and (e["pid"], e.get("tid")) not in streams):
      continue
    for start, end, key in windows:
      if start <= e["ts"] < end:
        calls[key]["kernels"].append((e["name"], e["ts"], e["dur"]))
        break
  return calls


def _busy(kernels) -> float:
  """The union of the kernels' intervals."""
  total, reach = 0.0, float("-inf")
  for _, t, d in sorted(kernels, key=lambda k: k[1]):
    total += max(0.0, t + d - max(t, reach))
    reach = max(reach, t + d)
  return total


def summary(calls: dict[tuple[str, int], dict], top: int | None = None) -> dict[str, dict]:
  """Per name, medians over its calls: wall, the kernels' span, busy time, per kernel (the ``top`` slowest by
  name, the rest as ``"other"``)."""
  out = {}
  for name in sorted({n for n, _ in calls}):
    mine = [c for (n, _), c in calls.items() if n == name]
    if not all(c["kernels"] for c in mine):  # no GPU in the trace (a CPU run): wall times only
      out[name] = {"calls": len(mine), "wall_ms": statistics.median(c["wall"] for c in mine) / 1e3}
      continue
    spans, busy, per_kernel = [], [], collections.defaultdict(list)
    for c in mine:
      starts = [t for _, t, _ in c["kernels"]]
      spans.append(max(t + d for _, t, d in c["kernels"]) - min(starts))
      busy.append(_busy(c["kernels"]))
      by_kernel = collections.Counter()
      for kernel, _, d in c["kernels"]:
        by_kernel[kernel] += d
      for kernel, d in by_kernel.items():
        per_kernel[kernel].append(d)
    ranked = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))
    kernels = {k: statistics.median(v) / 1e3 for k, v in ranked[:top]}
    if top is not None and len(ranked) > top:
      kernels["other"] = sum(statistics.median(v) for _, v in ranked[top:]) / 1e3
    out[name] = {"calls": len(mine), "wall_ms": statistics.median(c["wall"] for c in mine) / 1e3,
                 "span_ms": statistics.median(spans) / 1e3, "busy_ms": statistics.median(busy) / 1e3,
                 "kernels_ms": kernels}
  return out


def table(result: dict[str, dict], width: int = 70) -> str:
  """``summary``'s result, one line per name and one per kernel."""
  lines = []
  for name, r in result.items():
    gpu = f", GPU span {r['span_ms']:.3f} ms, busy {r['busy_ms']:.3f} ms" if "span_ms" in r else ", no GPU kernels"
    lines.append(f"{name}: {r['calls']} calls, wall {r['wall_ms']:.3f} ms{gpu}")
    lines += [f"  {kernel[:width]:{width}s} {ms:9.3f} ms" for kernel, ms in r.get("kernels_ms", {}).items()]
  return "\n".join(lines)


def traced(calls: dict, rounds: int, *, device: int | None = None, top: int | None = None,
           lines: list | None = None) -> dict[str, dict]:
  """``summary`` of ``calls`` (``{name: fn()}``, compiled and warm) run in ``rounds`` rotating rounds under the
  profiler; ``lines``, if given, gets the trace's GPU lines (``gpu_lines``)."""
  made = collections.Counter()

  def annotated(name):
    def call():
      with jax.profiler.TraceAnnotation(f"{CALL}{name}:{made[name]}"):
        jax.block_until_ready(calls[name]())
      made[name] += 1
    return call

  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
      measure.rounds({name: annotated(name) for name in calls}, rounds)
      time.sleep(0.1)
    path = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not path:
      raise RuntimeError(f"no perfetto_trace.json.gz under the profiler's {logdir}")
    with gzip.open(path[0]) as f:
      trace = json.load(f)
  if lines is not None:
    lines += gpu_lines(trace)
  return summary(kernels_by_call(trace, device), top)
