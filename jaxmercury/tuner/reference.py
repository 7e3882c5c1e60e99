"""The trusted output (and gradients) candidates are checked against, within a device's memory.

Small programs run their plain reference. A program whose body would need
more temporary memory than ``budget_bytes`` on one device runs as a local
schedule on one device: its loops tiled into serial blocks (the reduction
loops first) until one block fits; long block loops run as ``fori_loop``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from jaxmercury.analysis.memory import block_sizes
from jaxmercury.errors import ScheduleError
from jaxmercury.schedules.schedule import Schedule


def _workspace(schedule) -> int:
  prog = schedule.program
  return int(prog.workspace(block_sizes(schedule))) if prog.workspace else 0


def local_schedule(program, device, budget_bytes: int) -> Schedule:
  """A one-device schedule whose blocks fit ``budget_bytes`` of workspace."""
  mesh = jax.sharding.Mesh(np.array([device]), ("local",), axis_types=(AxisType.Auto,))
  s = Schedule(program, mesh)
  order = [a.name for a in program.loops if program.kinds[a.name] == "r"]
  order += [a.name for a in program.loops if program.kinds[a.name] == "s"]
  for axis in order:
    if _workspace(s) <= budget_bytes:
      break
    extent = s.loop(axis).extent
    need = -(-_workspace(s) // budget_bytes)
    factor = next((f for f in range(need, extent + 1) if extent % f == 0), extent)
    s.tile(axis, factor, names=(f"{axis}_blocks", f"{axis}_block"))
  if _workspace(s) > budget_bytes:
    raise ScheduleError(f"{program.name}: no tiling brings one block under {budget_bytes} bytes")
  return s


def _trusted(program, inputs, device, budget_bytes: int):
  """``(f, inputs)``: the plain reference, or where its body would not fit ``budget_bytes`` a tiled one-device
  schedule of it (with its own backward) and the inputs on ``device``."""
  full = {a: ax.extent for a, ax in program.axes.items()}
  if not program.workspace or program.workspace(full) <= budget_bytes:
    return jax.jit(program.reference), inputs  # one compile, not one per operation
  return local_schedule(program, device, budget_bytes).compile(), [jax.device_put(x, device) for x in inputs]


def reference_output(program, inputs, device, budget_bytes: int = 8 << 30):
  """``program.reference(*inputs)``, tiled on ``device`` when it would not fit."""
  fn, inputs = _trusted(program, inputs, device, budget_bytes)
  return fn(*inputs)


def _drawn_step(fn, written):
  """``(key, inputs) -> (cotangent, (output, gradients))`` as one compiled program: a normal output cotangent of
  ``written``'s shape and dtype drawn from ``key``, ``fn``'s output and its inputs' gradients for it. One program,
  where drawing, the forward and the pullback op by op would compile several."""
  def step(key, inputs):
    cotangent = jax.random.normal(jax.random.fold_in(key, 1), written.shape, jnp.float32).astype(written.dtype)
    out, pullback = jax.vjp(fn, *inputs)
    return cotangent, (out, tuple(pullback(cotangent.astype(out.dtype))))
  return jax.jit(step)


def trial(program, seed: int, device, *, training: bool = False, on_device: bool = False,
          budget_bytes: int = 8 << 30):
  """What a tune checks and times every candidate on: ``(inputs, cotangent, reference)``.

  The inputs are fresh normal values drawn from ``seed``. For the forward,
  ``cotangent`` is None and ``reference`` the trusted output; for a training
  step, ``cotangent`` is a normal output cotangent from the same seed and
  ``reference`` the trusted ``(output, gradients)``, computed with the
  cotangent as one program. The reference goes to the host (numpy arrays):
  each candidate's shards are checked against slices of it
  (``measure.local_error``), which on a device array would compile a slice
  per shard. With ``on_device`` (a mesh of one device, whose candidates'
  outputs are whole arrays on ``device``) it stays on ``device`` and is
  checked there, moved neither to the host nor back per candidate.
  """
  key = jax.random.key(seed)
  inputs = program.random_inputs(key)
  fn, placed = _trusted(program, inputs, device, budget_bytes)
  if on_device:  # computed where the candidates run, so that it stays there
    placed = jax.device_put(placed, device)
  if training:
    cotangent, reference = _drawn_step(fn, program.writes)(key, placed)
  else:
    cotangent, reference = None, fn(*placed)
  return inputs, cotangent, reference if on_device else _on_host(reference)


def _on_host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
