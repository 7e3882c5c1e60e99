"""Markdown tables and plots from a ``benchmarks.run`` results file.

  python -m benchmarks.report results.json [--md results.md] [--plots folder]

Tables: a summary with one row per configuration (best baseline, jaxmercury,
speedup, physical floor) and every contestant's numbers. Plots: jaxmercury's
speedup over the best baseline per configuration (attention: one line per
sweep over the sequence length; GEMM: one bar per case) and, for the case
marked ``fig13``, the design-space scatter of Mercury's Fig. 13: every
candidate the tuner considered (latency against memory per device) with the
baselines beside them.

No JAX needed: this reads the JSON only (matplotlib for the plots).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from benchmarks.suites import seq_label  # noqa: E402  (no JAX there either)

MIB = 2 ** 20
TOLERANCE = 2e-2
OUT_OF_TIME = "time budget spent"  # the skip reason of whatever the run's --time_budget left out


def out_of_time(rec: dict) -> bool:
  """Whether a record (a contestant or a case) was skipped only because the time budget ran out.

  Such a skip is no failure: the case stays for ``--resume``. Records carry
  ``out_of_time``; those of older results files are known by their reason.
  """
  return bool(rec.get("out_of_time")) or str(rec.get("skipped", "")).startswith(OUT_OF_TIME)


def late_contestants(case: dict) -> list[str]:
  """The case's contestants skipped because the time budget ran out."""
  return [c["name"] for c in case.get("contestants", []) if out_of_time(c)]


def finished(case: dict) -> bool:
  """Whether ``--resume`` keeps the case: it ran, and no contestant was left out for time."""
  return case.get("status") not in (None, "skipped") and not late_contestants(case)


def _fmt(x, spec: str) -> str:
  return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _cell(text) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def status(rec: dict) -> str:
  """A contestant's outcome in a few words."""
  if "skipped" in rec:
    return "skipped: " + rec["skipped"]
  if "error" in rec:
    return "ERROR: " + rec["error"].splitlines()[0][:160]
  if rec.get("numerics_ok") is False:
    why = f": {rec['disagreement']}" if rec.get("disagreement") else ""
    return f"DISAGREES (rel err {rec.get('rel_err', float('nan')):.2e}){why}"
  if "median_ms" in rec:
    return "ok"
  return "not timed"


def _contestant(case: dict, name: str) -> dict:
  return next((c for c in case.get("contestants", []) if c["name"] == name), {})


def header(results: dict) -> str:
  smoke = (" **Smoke run on a simulated CPU mesh: the times are CPU times and say nothing about GPUs.**"
           if results.get("smoke") else "")
  return (f"Benchmarks of {results.get('date', '?')}: {results.get('n_devices', '?')} x "
          f"{results.get('device', '?')} ({results.get('platform', '?')}), jax {results.get('jax_version', '?')} "
          f"(jaxlib {results.get('jaxlib_version', '?')}), jaxmercury {results.get('jaxmercury_version', '?')}, "
          f"python {results.get('python', '?')}; `{results.get('command', '')}`; inputs' seed "
          f"{results.get('seed', '?')}.{smoke}")


def summary_table(results: dict) -> str:
  """One row per configuration that ran."""
  rows = ["| case | best baseline | baseline ms | jaxmercury schedule | jaxmercury ms | speedup vs best "
          "baseline | floor ms (bound) | jaxmercury / floor | agree |",
          "|---|---|---|---|---|---|---|---|---|"]
  for case in results.get("cases", []):
    if case.get("status") == "skipped":
      continue
    if case.get("status") == "error":
      rows.append(f"| {_cell(case['name'])} | | | | | | | | ERROR: {_cell(case.get('error', ''))[:120]} |")
      continue
    jm = _contestant(case, "jaxmercury")
    floor = case.get("floor", {})
    bound = f" ({floor['bound']})" if floor.get("bound") else ""
    jm_name = jm.get("schedule", "") if "median_ms" in jm else status(jm)[:80]
    rows.append(
        f"| {_cell(case['name'])} | {case.get('best_baseline') or ''} | {_fmt(case.get('best_baseline_ms'), '.3f')} | "
        f"{_cell(jm_name)} | {_fmt(jm.get('median_ms'), '.3f')} | "
        f"{_fmt(jm.get('ratio_to_best_baseline'), '.2f')}{'x' if jm.get('ratio_to_best_baseline') else ''} | "
        f"{_fmt(floor.get('floor_ms'), '.3f')}{bound} | {_pct(jm.get('floor_fraction'))} | "
        f"{'yes' if case.get('agree', True) else 'NO'} |")
  return "\n".join(rows)


def _pct(x) -> str:
  return "" if x is None else f"{100 * x:.0f}%"


def detail_table(results: dict) -> str:
  """Every contestant of every configuration."""
  rows = ["| case | contestant | median ms | min ms | x best baseline | of floor | TFLOP/s/dev | MiB/dev | "
          "rel err | status |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for case in results.get("cases", []):
    for rec in case.get("contestants", []):
      mem = rec.get("memory_bytes")
      rows.append(
          f"| {_cell(case['name'])} | {rec['name']} | {_fmt(rec.get('median_ms'), '.3f')} | "
          f"{_fmt(rec.get('min_ms'), '.3f')} | {_fmt(rec.get('ratio_to_best_baseline'), '.2f')} | "
          f"{_pct(rec.get('floor_fraction'))} | {_fmt(rec.get('tflops_per_device'), '.3g')} | "
          f"{_fmt(mem / MIB if mem else None, '.1f')} | {_fmt(rec.get('rel_err'), '.1e')} | "
          f"{_cell(status(rec))[:200]} |")
  return "\n".join(rows)


def floor_table(results: dict) -> str:
  rows = ["| case | compute ms | communication ms | bytes / device | floor ms | how |", "|---|---|---|---|---|---|"]
  for case in results.get("cases", []):
    f = case.get("floor")
    if not f:
      continue
    rows.append(f"| {_cell(case['name'])} | {_fmt(f.get('compute_ms'), '.3f')} | {_fmt(f.get('comm_ms'), '.3f')} | "
                f"{_fmt(f.get('comm_bytes_per_device'), '.3g')} | {_fmt(f.get('floor_ms'), '.3f')} | "
                f"{_cell(f.get('compute_how', ''))}; {_cell(f.get('comm_how', ''))} |")
  return "\n".join(rows)


def notes(results: dict) -> list[str]:
  out = []
  for name, link in sorted(results.get("links", {}).items()):
    if "bytes_per_s" in link:
      out.append(f"- link over mesh {name}: {link['bytes_per_s'] / 1e9:.1f} GB/s per device "
                 f"(ppermute of {link['bytes_per_device'] / MIB:.0f} MiB in {link['ms']:.3f} ms)")
  win = results.get("windowed_subprocess", {})
  if win:
    out.append(f"- XLA windowed einsum (`xla_auto_windowed`) timed in a subprocess with XLA_FLAGS += "
               f"`{win.get('flags', '')}`: {win.get('status', '')}")
  skipped = [c["name"] for c in results.get("cases", []) if c.get("status") == "skipped"]
  if skipped:
    out.append(f"- not run (time budget): {len(skipped)} cases, from {skipped[0]}")
  partial = [c["name"] for c in results.get("cases", []) if c.get("status") != "skipped" and late_contestants(c)]
  if partial:
    out.append(f"- incomplete (time budget): {len(partial)} cases ran with contestants skipped for time, from "
               f"{partial[0]}; --resume runs them again")
  for stop in results.get("sweep_stops", []):
    out.append(f"- sweep {stop['family']} stopped: {stop['reason']}")
  if results.get("unfinished"):
    out.append(f"- {results['unfinished']}")
  return out


def markdown(results: dict) -> str:
  """The whole report: header, summary, every contestant, floors, notes."""
  parts = [header(results), "", summary_table(results), "", detail_table(results), "", floor_table(results)]
  extra = notes(results)
  if extra:
    parts += [""] + extra
  return "\n".join(parts)


def problems(results: dict, strict: bool = False) -> list[str]:
  """Disagreements (always) and, with ``strict``, any error or failed case."""
  bad = []
  for case in results.get("cases", []):
    for rec in case.get("contestants", []):
      if rec.get("numerics_ok") is False:
        bad.append(f"{case['name']}: {rec['name']} disagrees ({status(rec)})")
      elif strict and "error" in rec:
        bad.append(f"{case['name']}: {rec['name']}: {rec['error'][:160]}")
    if strict and case.get("status") in ("error", "failed"):
      bad.append(f"{case['name']}: case {case['status']} {case.get('error', '')[:160]}")
    if case.get("reference_vs_program", 0.0) >= TOLERANCE:
      bad.append(f"{case['name']}: the reference disagrees with the program's own reference")
  return bad


# ------------------------------------------------------------------ plots


def _figure(width=7.5, height=4.8):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(width, height))
  FigureCanvasAgg(fig)
  return fig


def _slug(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def _speedups(results: dict, suite: str):
  """(case, speedup) of the cases of ``suite`` where jaxmercury and a baseline were timed."""
  out = []
  for case in results.get("cases", []):
    if case.get("suite") != suite:
      continue
    ratio = _contestant(case, "jaxmercury").get("ratio_to_best_baseline")
    if ratio is not None:
      out.append((case, ratio))
  return out


def attention_speedup_plot(results: dict, path: str) -> str | None:
  """jaxmercury's speedup over the best baseline against the sequence length, one line per sweep."""
  points = _speedups(results, "attention")
  if not points:
    return None
  fig = _figure()
  ax = fig.add_subplot()
  families = {}
  for case, ratio in points:
    families.setdefault(case["family"], []).append((case["size"], ratio))
  for family, pts in families.items():
    pts.sort()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=family.replace("attention ", ""))
  ax.axhline(1.0, color="gray", linewidth=1, linestyle="--")
  ax.set_xscale("log", base=2)
  from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
  sizes = sorted({case["size"] for case, _ in points})
  ax.xaxis.set_major_locator(FixedLocator(sizes))
  ax.xaxis.set_minor_locator(NullLocator())
  ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: seq_label(int(v))))
  ax.set_xlabel("sequence length")
  ax.set_ylabel("speedup over the best baseline")
  ax.set_title(_plot_title(results, "attention: jaxmercury vs the best baseline"), fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  return path


def gemm_speedup_plot(results: dict, path: str) -> str | None:
  """jaxmercury's speedup over the best baseline, one bar per GEMM case."""
  points = _speedups(results, "gemm")
  if not points:
    return None
  fig = _figure(max(7.5, 0.35 * len(points) + 2), 4.8)
  ax = fig.add_subplot()
  labels = [c["name"].replace("gemm ", "") for c, _ in points]
  ratios = [r for _, r in points]
  colors = ["tab:green" if r >= 1 else "tab:red" for r in ratios]
  ax.bar(range(len(points)), ratios, color=colors)
  ax.axhline(1.0, color="gray", linewidth=1, linestyle="--")
  ax.set_xticks(range(len(points)))
  ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
  ax.set_ylabel("speedup over the best baseline")
  ax.set_title(_plot_title(results, "GEMM: jaxmercury vs the best baseline"), fontsize=9)
  ax.grid(True, axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  return path


def _plot_title(results: dict, what: str) -> str:
  cpu = " (SIMULATED CPU)" if results.get("smoke") else ""
  return (f"{what}{cpu}\n{results.get('n_devices', '?')} x {results.get('device', '?')}, "
          f"jax {results.get('jax_version', '?')}, {str(results.get('date', ''))[:10]}")


def pareto_front(points):
  """The points with the lowest latency for at most their memory (the tuner plot's front)."""
  from jaxmercury.tuner.plot import pareto_front as front
  return front(points)


def design_space_plot(results: dict, case: dict, path: str) -> str | None:
  """Mercury's Fig. 13 for one case: the tuner's candidates and the baselines, latency against memory.

  Timed candidates are at their compiled memory per device and the tuner's
  measured time; pruned and failed ones (lighter) at the estimated memory
  and the predicted time. Baselines and jaxmercury's winner are at their
  compiled memory and the case's interleaved median.
  """
  cands = case.get("tuner", {}).get("candidates") or []
  if not cands:
    return None
  fig = _figure()
  ax = fig.add_subplot()
  ok = [((c.get("compiled_bytes") or c["memory_bytes"]) / MIB, c["time_ms"], c["name"]) for c in cands
        if c["status"] == "ok" and c.get("time_ms") is not None]
  other = [(c["memory_bytes"] / MIB, c["predicted_ms"], c["name"]) for c in cands
           if c["status"] != "ok" and c.get("predicted_ms") is not None and c.get("memory_bytes")]
  if other:
    ax.scatter([p[0] for p in other], [p[1] for p in other], s=20, facecolors="none", edgecolors="tab:red",
               alpha=0.4, label="candidates pruned / failed (predicted ms, estimated MiB)")
  if ok:
    ax.scatter([p[0] for p in ok], [p[1] for p in ok], s=24, color="tab:red", label="candidates timed by the tuner")
    front = pareto_front(ok)
    ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="tab:red", alpha=0.5,
            linewidth=1, label="tuner's Pareto front")
    for x, y, name in ok:  # library strategies by name; sampled schedules stay unlabeled
      if "(" not in name:
        ax.annotate(name, (x, y), xytext=(4, -10), textcoords="offset points", fontsize=6, color="tab:red")
  markers = {"cp_allgather": "s", "ring": "^", "ulysses": "D", "usp": "P"}
  legend = True
  for rec in case.get("contestants", []):
    if "median_ms" not in rec or not rec.get("memory_bytes"):
      continue
    x, y = rec["memory_bytes"] / MIB, rec["median_ms"]
    if rec["name"] == "jaxmercury":
      ax.scatter([x], [y], s=180, marker="*", color="tab:orange", edgecolors="black", zorder=5,
                 label=f"jaxmercury winner: {rec.get('schedule', '')[:40]}")
    else:
      ax.scatter([x], [y], s=60, marker=markers.get(rec["name"], "o"), color="tab:blue", zorder=4,
                 label="baselines (interleaved median)" if legend else None)
      legend = False
      ax.annotate(rec["name"], (x, y), xytext=(5, 4), textcoords="offset points", fontsize=8, color="tab:blue")
  ys = [p[1] for p in ok + other] + [r["median_ms"] for r in case.get("contestants", []) if "median_ms" in r]
  ys = [y for y in ys if y and y > 0]
  if ys and max(ys) / min(ys) > 20:
    ax.set_yscale("log")
  ax.set_xlabel("memory per device (MiB)")
  ax.set_ylabel("latency (ms)")
  ax.set_title(_plot_title(results, f"design space (Mercury Fig. 13): {case['name']}"), fontsize=8)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  return path


def plots(results: dict, folder: str, fig13_case: str | None = None) -> list[str]:
  """Writes every plot into ``folder``; returns their paths (none when matplotlib is missing)."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return []
  os.makedirs(folder, exist_ok=True)
  out = [attention_speedup_plot(results, os.path.join(folder, "speedup-attention.png")),
         gemm_speedup_plot(results, os.path.join(folder, "speedup-gemm.png"))]
  for case in results.get("cases", []):
    if (fig13_case is None and case.get("fig13")) or case["name"] == fig13_case:
      out.append(design_space_plot(results, case, os.path.join(folder, f"fig13-{_slug(case['name'])}.png")))
  return [p for p in out if p]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("results", help="a benchmarks.run results JSON")
  p.add_argument("--md", default=None, help="write the markdown here (default: print it)")
  p.add_argument("--plots", default=None, help="write the plots into this folder")
  p.add_argument("--fig13", default=None, help="draw the design-space scatter of this case")
  args = p.parse_args(argv)
  with open(args.results, encoding="utf-8") as f:
    results = json.load(f)
  text = markdown(results)
  if args.md:
    with open(args.md, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  else:
    print(text)
  if args.plots:
    for path in plots(results, args.plots, args.fig13):
      print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
