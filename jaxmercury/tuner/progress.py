"""What a tune shows while it runs: the calibration's progress (a bar on a terminal, lines otherwise)."""

from __future__ import annotations

import sys
import time

BAR = 24


def calibration_progress(log):
  """``progress(step, done, total)`` for ``calibrate``: a bar redrawn in place when ``log`` is ``print`` to a
  terminal, else one ``log`` line per step; the last call says how long it took."""
  start = time.perf_counter()
  terminal = log is print and sys.stdout.isatty()

  def progress(step: str, done: int, total: int):
    seconds = time.perf_counter() - start
    if terminal:
      bar = "#" * (BAR * done // max(total, 1))
      end = "\n" if done >= total else ""
      print(f"\r  calibrating [{bar:<{BAR}}] {done}/{total} {step:<28} {seconds:5.1f} s", end=end, flush=True)
    elif done >= total:
      log(f"  calibrated: {total} measurements in {seconds:.1f} s")
    else:
      log(f"  calibrating {done + 1}/{total}: {step} ({seconds:.1f} s)")

  return progress
