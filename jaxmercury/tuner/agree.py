"""Agreement across the processes of a multi-process (multi-host) run.

Under ``jax.distributed`` every process must compile and run the same
candidates in the same order, or their collectives deadlock. The tuner makes
each decision once, on process 0, and broadcasts it as JSON
(``broadcast_json``); measurements are combined with ``gather`` (an
all-gather; the caller takes the maximum, so the slowest process counts).
With one process both are the identity.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.experimental import multihost_utils


def process_count() -> int:
  return jax.process_count()


def is_leader() -> bool:
  """Whether this process makes the decisions (process 0)."""
  return jax.process_index() == 0


def broadcast_json(value):
  """Process 0's ``value`` (JSON-able) on every process.

  The JSON text travels as a uint8 array: first its length, then the bytes,
  so that every process passes arrays of one shape.
  """
  if process_count() == 1:
    return value
  data = json.dumps(value, sort_keys=True).encode() if is_leader() else b""
  n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int32))))
  buf = np.frombuffer(data, np.uint8) if is_leader() else np.zeros(n, np.uint8)
  got = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
  return json.loads(got.tobytes().decode())


def gather(values) -> np.ndarray:
  """``values`` of every process, stacked along a new first axis (process order)."""
  values = np.asarray(values)
  if process_count() == 1:
    return values[None]
  out = np.asarray(multihost_utils.process_allgather(values.astype(np.float32)), np.float64)
  return out.reshape((process_count(),) + values.shape)


def local_device(mesh):
  """A device of ``mesh`` this process can address (the first one)."""
  me = jax.process_index()
  return next((d for d in mesh.devices.flat if d.process_index == me), jax.local_devices()[0])
