"""Where a program's GPU time goes, kernel by kernel, from Nsight Compute's raw page of kernel durations.

    ncu --metrics gpu__time_duration.sum -o report python3 -m benchmarks.ws_profile --training ...
    ncu -i report.ncu-rep --page raw --csv --metrics gpu__time_duration.sum > kernels.csv
    python -m benchmarks.ncu_kernels kernels.csv --calls 2

For a program that made ``--calls`` identical calls (a warm-up and the profiled ones), each kernel name's
launches and time per call, longest first, and their total: what one call costs on the GPU kernel by kernel,
launches run one at a time (ncu serializes them).
"""

from __future__ import annotations

import argparse
import collections
import csv
import io

DURATION = "gpu__time_duration.sum"
SCALE_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6,
               "s": 1e6}


def durations(text: str) -> list[tuple[str, float]]:
  """``(kernel name, microseconds)`` per launch, in launch order, from ncu's ``--page raw --csv`` output."""
  lines = [line for line in text.splitlines() if line.startswith('"')]  # ncu's own messages start with ==
  header, units, *rows = csv.reader(io.StringIO("\n".join(lines)))
  name, time = header.index("Kernel Name"), header.index(DURATION)
  scale = SCALE_TO_US[units[time]]
  return [(row[name], float(row[time].replace(",", "")) * scale) for row in rows if len(row) == len(header)]


def table(launches: list[tuple[str, float]], calls: int, width: int = 90) -> str:
  """Per kernel name: launches and microseconds per call, longest first, then the total."""
  count, total = collections.Counter(), collections.Counter()
  for name, us in launches:
    count[name] += 1
    total[name] += us
  grand = sum(total.values()) or 1.0
  out = [f"{'kernel':{width}s} {'launches':>8s} {'us/call':>10s} {'share':>6s}"]
  for name, us in total.most_common():
    out.append(f"{name[:width]:{width}s} {count[name] / calls:8.2f} {us / calls:10.1f} {us / grand:6.1%}")
  out.append(f"{'total':{width}s} {len(launches) / calls:8.2f} {grand / calls:10.1f}")
  return "\n".join(out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("csv")
  parser.add_argument("--calls", type=int, default=1, help="identical calls the profiled program made")
  args = parser.parse_args(argv)
  with open(args.csv) as f:
    print(table(durations(f.read()), args.calls))


if __name__ == "__main__":
  main()
