"""Compiling a tune's candidates several at once, before any of them runs.

Compiling is most of a tune's time, and most of a compile runs outside
Python's lock (XLA's passes, LLVM, ptxas), so candidates compiled on a few
threads at once take a fraction of the time one after another would. They
are all compiled before the first is run or timed: a compile running beside a
timed run would take the lock from the thread timing it.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading

from jaxmercury.tuner import measure

MAX_THREADS = 16


def default_threads() -> int:
  """Compile threads when the caller names none: one per CPU core, ``MAX_THREADS`` at most."""
  return max(1, min(MAX_THREADS, os.cpu_count() or 1))


def compile_all(schedules: list, *, training: bool, threads: int, time_limit_s: float | None) -> list:
  """Starts compiling ``schedules`` (``measure.compile_ahead``) on ``threads`` threads and waits until all are
  compiled or ``time_limit_s`` has passed.

  Args:
    schedules: the schedules (or plain programs) to compile.
    training: compile their training steps.
    threads: how many compile at once.
    time_limit_s: seconds to wait at most; a compile not done by then goes on in its (daemon) thread, and
      ``measure.measure`` waits for it within its own limit.

  Returns:
    One ``concurrent.futures.Future`` per schedule, in order: the compiled program or the compile's exception.
  """
  futures = [concurrent.futures.Future() for _ in schedules]
  work = queue.SimpleQueue()
  for item in zip(schedules, futures):
    work.put(item)

  def worker():
    while True:
      try:
        schedule, future = work.get_nowait()
      except queue.Empty:
        return
      try:
        future.set_result(measure.compile_ahead(schedule, training=training))
      except Exception as e:
        future.set_exception(e)

  for k in range(min(threads, len(schedules))):
    threading.Thread(target=worker, name=f"jaxmercury-compile-{k}", daemon=True).start()
  concurrent.futures.wait(futures, timeout=time_limit_s)
  return futures
