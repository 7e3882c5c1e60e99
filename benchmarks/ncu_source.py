"""Where a kernel's warps stall, from Nsight Compute's source page: per SASS opcode, then per instruction.

    ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv
    python -m benchmarks.ncu_source source.csv attention_backward_ws [--top 30]

For each profiled launch of a kernel whose name contains the given text, in launch order: the share of warp
stall samples and the instructions executed per opcode, the stall reasons over all instructions, and the
instructions with the most samples (their address, share, executions, text and two largest stall reasons).
Every warp of the kernel is sampled, waiting ones too: a producer warpgroup spinning on a barrier shows as its
loop's branch.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io

SAMPLES = "Warp Stall Sampling (All Samples)"
KERNEL = '"Kernel Name"'


def kernels(text: str) -> list[tuple[str, list[dict]]]:
  """``(name, rows)`` per kernel of an ncu source-page CSV, rows keyed by the page's column names."""
  found, name, lines = [], None, []
  for line in text.splitlines() + [KERNEL + ","]:
    if line.startswith(KERNEL):
      if name is not None:
        header, *rows = csv.reader(io.StringIO("\n".join(lines)))
        found.append((name, [dict(zip(header, row)) for row in rows if len(row) == len(header)]))
      name, lines = line.split(",", 1)[1].strip().strip(',').strip('"'), []
    elif name is not None:
      lines.append(line)
  return found


def _count(row: dict, column: str) -> float:
  try:
    return float(row.get(column) or 0)
  except ValueError:
    return 0.0


def _opcode(source: str) -> str:
  words = source.split()
  words = words[1:] if words and words[0].startswith("@") else words  # a predicate
  return words[0].split(".")[0] if words else ""


def summary(rows: list[dict], top: int) -> str:
  """The opcode table, the stall reasons and the ``top`` instructions, as text."""
  total = sum(_count(r, SAMPLES) for r in rows) or 1.0
  samples, executed = collections.Counter(), collections.Counter()
  for r in rows:
    samples[_opcode(r["Source"])] += _count(r, SAMPLES)
    executed[_opcode(r["Source"])] += _count(r, "Instructions Executed")
  out = [f"{len(rows)} instructions, {total:.0f} samples, {sum(executed.values()):,.0f} executed"]
  out += [f"  {op:12s} samples {n / total:6.1%}  executed {executed[op]:,.0f}" for op, n in samples.most_common(20)]
  reasons = [c for c in rows[0] if c.startswith("stall_")] if rows else []
  stalls = collections.Counter({c[6:]: sum(_count(r, c) for r in rows) for c in reasons})
  stalled = sum(stalls.values()) or 1.0
  out.append("stall reasons: " + ", ".join(f"{k} {v / stalled:.1%}" for k, v in stalls.most_common(12)))
  for r in sorted(rows, key=lambda r: -_count(r, SAMPLES))[:top]:
    why = sorted(((_count(r, c), c[6:]) for c in reasons if "Not Issued" not in c and _count(r, c)), reverse=True)[:2]
    share, runs = _count(r, SAMPLES) / total, _count(r, "Instructions Executed")
    out.append(f"  {r['Address'][-6:]} {share:6.2%} ex={runs:>13,.0f}  {r['Source'][:70]:70s} "
               + ", ".join(w for _, w in why))
  return "\n".join(out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("csv")
  parser.add_argument("kernel", help="text in the kernel's name (each of its profiled launches is summarized)")
  parser.add_argument("--top", type=int, default=30)
  args = parser.parse_args(argv)
  with open(args.csv) as f:
    matches = [(name, rows) for name, rows in kernels(f.read()) if args.kernel in name]
  if not matches:
    raise SystemExit(f"no kernel whose name contains {args.kernel!r} in {args.csv}")
  for i, (name, rows) in enumerate(matches):
    print(f"== {name}, launch {i + 1} of {len(matches)}\n{summary(rows, args.top)}")


if __name__ == "__main__":
  main()
