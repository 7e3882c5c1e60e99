"""The SM clock and power each contestant ran at: nvidia-smi sampled while the contestants run in sustained blocks.

A GPU at its power cap sets its clock by the power drawn, so two kernels' times differ by their clocks as well as
by their work. ``Sampler`` runs ``nvidia-smi`` in the background (every ``PERIOD_MS``) over the GPUs this process
sees; ``Calls`` records when each contestant's runs started; ``by_contestant`` gives each contestant the samples
taken inside its blocks (a block: its runs back to back, from the second half on, after the clock settled), as
means of the SM clock, power and temperature and the set of clock-limiting reasons.
"""

from __future__ import annotations

import collections
import datetime
import os
import shutil
import subprocess
import time

QUERY = "index,timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
PERIOD_MS = 100
MIN_BLOCK_S = 0.2  # runs of one contestant further apart than this are separate blocks


def parse(text: str) -> list[tuple]:
  """``(epoch seconds, GPU index, SM MHz, watts, degrees C, reasons)`` per line of nvidia-smi's CSV (local time,
  no units); lines that do not parse (a field the GPU does not report) are left out."""
  rows = []
  for line in text.splitlines():
    parts = [x.strip() for x in line.split(",")]
    try:
      stamp = datetime.datetime.strptime(parts[1], "%Y/%m/%d %H:%M:%S.%f").timestamp()
      rows.append((stamp, int(parts[0]), float(parts[2]), float(parts[3]), float(parts[4]), parts[5]))
    except (ValueError, IndexError):
      continue
  return rows


def _visible() -> str | None:
  """nvidia-smi's ``--id`` for the GPUs ``CUDA_VISIBLE_DEVICES`` names by index (None: every GPU)."""
  ids = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
  return ids if ids and all(x.strip().isdigit() for x in ids.split(",")) else None


class Sampler:
  """``nvidia-smi`` sampling in the background from construction to ``stop()`` (nothing where there is none)."""

  def __init__(self):
    smi = shutil.which("nvidia-smi")
    ids = _visible()
    command = [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(PERIOD_MS)]
    self.process = smi and subprocess.Popen(command + ([f"--id={ids}"] if ids else []), stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, text=True)

  def stop(self) -> list[tuple]:
    """The samples (``parse``'s rows); the sampler ends."""
    if not self.process:
      return []
    time.sleep(2 * PERIOD_MS / 1e3)
    self.process.terminate()
    return parse(self.process.communicate(timeout=10)[0])


class Calls:
  """When each contestant's runs started: ``wrap(name, call)`` records ``(name, time.time())`` per run."""

  def __init__(self):
    self.starts: list[tuple[str, float]] = []

  def wrap(self, name: str, call):
    def recorded():
      self.starts.append((name, time.time()))
      return call()
    return recorded

  def blocks(self) -> list[tuple[str, float, float]]:
    """``(name, start, end)`` of each block: one contestant's consecutive runs, ``MIN_BLOCK_S`` long at least."""
    out = []
    for name, t in self.starts:
      if out and out[-1][0] == name:
        out[-1][2] = t
      else:
        out.append([name, t, t])
    return [(n, s, e) for n, s, e in out if e - s >= MIN_BLOCK_S]


def by_contestant(blocks, samples) -> dict[str, dict]:
  """Per contestant, over the second half of each of its blocks: the mean SM clock (MHz), power (W, summed over
  the GPUs sampled) and temperature (C), the samples counted and the clock-limiting reasons seen."""
  per = collections.defaultdict(list)
  for name, start, end in blocks:
    per[name] += [x for x in samples if (start + end) / 2 <= x[0] <= end]
  out = {}
  for name, rows in per.items():
    if not rows:
      continue
    gpus = len({x[1] for x in rows})
    mean = lambda k, rows=rows: sum(x[k] for x in rows) / len(rows)
    out[name] = {"sm_mhz": round(mean(2)), "power_w": round(mean(3) * gpus, 1), "temp_c": round(mean(4), 1),
                 "samples": len(rows), "gpus": gpus, "reasons": sorted({x[5] for x in rows})}
  return out
