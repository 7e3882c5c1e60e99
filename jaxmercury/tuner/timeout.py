"""A hard time limit on a function run in this process: the caller stops waiting for it (``run_limited``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def run_limited(fn: Callable, limit_s: float | None):
  """``(fn(), False)``, or ``(None, True)`` if ``fn`` has not returned after ``limit_s`` seconds.

  Without a limit ``fn`` runs in this thread. Exceptions raised by ``fn``
  propagate; so does ``KeyboardInterrupt`` while waiting.
  """
  if limit_s is None:
    return fn(), False
  box = {}

  def target():
    try:
      box["value"] = fn()
    except BaseException as e:
      box["error"] = e

  thread = threading.Thread(target=target, name="jaxmercury-candidate", daemon=True)
  thread.start()
  deadline = time.monotonic() + max(limit_s, 0.0)
  while thread.is_alive():
    left = deadline - time.monotonic()
    if left <= 0:
      return None, True
    thread.join(min(left, 0.5))
  if "error" in box:
    raise box["error"]
  return box.get("value"), False
