"""The propose stage: the candidates of a tune, as data.

The library's strategies, then a sample of the design space, each with every
local kernel that applies and each with every fused lowering that applies
(``Schedule.lower_with``: the whole nest as one fused kernel); on a mesh of
one device the local nest (``"local"``) with each kernel and fused lowering.
Beside them stand the plain programs (``tuner.plain``): what the user would
otherwise run, in the caller's layouts. On one device a ring attention's ring
is empty: what it computes there is a local attention, which the local
candidates time, so it is offered pruned (``ONE_DEVICE_RING``), never
compiled. A fused kernel that computes what a strategy computes but cannot
run here (another device kind, several processes) is named with the reason
(``not_offered``), so that a tune's table says why it is missing.
"""

from __future__ import annotations

import json
import math
import random

from jaxmercury.analysis import dispatch as dispatches
from jaxmercury.analysis import placements
from jaxmercury.errors import PreconditionError, ScheduleError
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import registry
from jaxmercury.schedules.library import library
from jaxmercury.schedules.schedule import Schedule
from jaxmercury.tuner import measure
from jaxmercury.tuner.candidates import GIVEN, LIBRARY, PLAIN, SPACE, Candidate, kernel_choices, program_key
from jaxmercury.tuner.plain import plain_programs
from jaxmercury.tuner.space import enumerate_schedules


def propose(task, config, given=None) -> list[Candidate]:
  """The plain programs for the caller's layouts, then the caller's candidates (``given``: ``Candidate``s or
  ``(name, Schedule)`` pairs) or the default ones (``default_candidates``); unscored."""
  plain = [Candidate(p.name, p, math.nan, p.memory_bytes(), origin=PLAIN)
           for p in plain_programs(task.program, task.mesh, task.in_shardings, task.out_sharding)]
  if given is not None:
    return plain + [c if isinstance(c, Candidate) else Candidate(c[0], c[1], math.nan, 0, origin=GIVEN)
                    for c in given]
  return plain + default_candidates(task.program, task.mesh, space=config.space, in_shardings=task.in_shardings,
                                    out_sharding=task.out_sharding, training=config.training)


def not_offered(program, mesh) -> dict[str, str]:
  """Per fused kernel that computes what one of the library's strategies computes but runs none of them here,
  why not (for the first such strategy)."""
  out, offered = {}, set()
  schedules = list(library(program, mesh).values())
  for k in registry.fused_kernels():
    for s in schedules:
      p = placements.place(k, s)
      if isinstance(p, str) or p.kind != k.placement:
        continue
      reason = placements.why_not(k, s)
      if reason is None:
        offered.add(k.name)
        break
      out.setdefault(k.name, reason)
  return {name: why for name, why in out.items() if name not in offered}


def describe(schedule) -> str:
  """A short name for a schedule: its distributing primitives and serial tiles."""
  short = {"parallelize": "par", "shift": "shift", "shard": "shard", "replicate": "repl", "pad": "pad",
           "patch": "patch"}
  parts = []
  for step in schedule.trace:
    name, args = step["primitive"], step["args"]
    if name == "tile":
      outer = schedule.loop_or_none(step["kwargs"].get("names", [args[0] + "0"])[0])
      if outer is not None and outer.role == "serial" and not outer.shifted_by:
        parts.append(f"tile({args[0]},{args[1]})")
    elif name in short:
      parts.append(f"{short[name]}({','.join(map(str, args))})")
  return " ".join(parts) or "local"


def default_candidates(program, mesh, *, space: int = 24, seed: int = 0, kernels=None,
                       in_shardings=None, out_sharding=None, training: bool = False) -> list[Candidate]:
  """The library strategies, then a sample of the design space, each with every applicable kernel.

  Each schedule is also offered with every fused kernel that applies to it
  (``analysis.placements.offered``) for the caller's layouts (``in_shardings``,
  ``out_sharding``), unless it would run in interpret mode (outside
  ``registry.interpret_mode()``). A design-space schedule's fused kernel that runs the same kernel on the
  same blocks as an earlier candidate's is left out (the library's strategies keep theirs: their backward
  passes differ). The design space is sampled among schedules that lower to programs no library strategy
  lowers to (``program_key``). On a mesh of one device the local loop nest comes first, as the strategy
  ``"local"``; the library's strategies follow (the tuner merges them into it: each is the local nest
  there), those that tile the nest into serial blocks pruned, those lowered with a ring attention pruned
  (``ONE_DEVICE_RING``), and no design space is sampled: a tune times one candidate per kernel. Candidates are
  returned unscored (``predicted_ms`` NaN).

  Args:
    kernels: the local kernels to try (``KernelChoice``s or names); default each that applies, at its
      defaults (``candidates.kernel_choices``).
    training: also offer each fused kernel with every other backward its configuration names
      (``lowering_variants``: a fused ring attention's backward on our kernel as well as on cuDNN's).
  """
  base = [(name, LIBRARY, s, None) for name, s in library(program, mesh).items()]
  one_device = math.prod(mesh.shape.values()) == 1
  if one_device:
    local = Schedule(program, mesh)
    key = program_key(local)
    tiled = measure.Measurement(measure.PRUNED, reason="one device: it tiles the local loop nest into serial "
                                                       "blocks, which a one-device tune does not try")
    base = [("local", LIBRARY, local, None)] + [(n, o, s, None if program_key(s) == key else tiled)
                                                for n, o, s, _ in base]
  else:
    seen = {program_key(s) for _, _, s, _ in base}
    rest = []
    for s in enumerate_schedules(program, mesh, tile_factors=(2, 4)):
      key = program_key(s)
      if key not in seen:
        seen.add(key)
        rest.append(s)
    base += [(describe(s), SPACE, s, None) for s in random.Random(seed).sample(rest, min(space, len(rest)))]
  strategies = sum(1 for _, origin, _, _ in base if origin == LIBRARY)
  kernels = kernel_choices(program, mesh) if kernels is None else [
      k if isinstance(k, registry.KernelChoice) else registry.KernelChoice(k) for k in kernels]
  out, kernels_seen = [], set()
  for n, (name, origin, s, pruned) in enumerate(base):
    if s.dispatched is not None:  # its local kernel is its grouped GEMM, a parameter of the dispatch
      out += [Candidate(name, v, math.nan, 0, result=pruned, origin=origin) for v in grouped_gemm_variants(s)]
      continue
    for k in kernels:
      patched = s.copy() if k.name == "xla" else s.copy().patch(k)
      out.append(Candidate(name, patched, math.nan, 0, result=pruned, origin=origin))
    for lowering in _fused_lowerings(s, in_shardings, out_sharding):
      for params in lowering_variants(lowering, mesh, training):
        try:
          lowered = s.copy().lower_with(lowering, **params)
        except PreconditionError:  # a backward whose blocks do not fit this schedule's
          continue
        key = (placements.signature(lowered), tuple(params.items()))
        if n < strategies or key not in kernels_seen:
          kernels_seen.add(key)
          why = pruned or (_one_device_ring(lowering) if one_device else None)
          out.append(Candidate(name, lowered, math.nan, 0, result=why, origin=origin))
  return out


# On one device a ring attention (a fused kernel priced at its own rate, ``calibrate.fused_rates``) runs no ring: its
# compute is a local attention's (``fused_ring_attention_ws``'s is ``ws_attention``'s forward; ``fused_ring_attention``
# is a one-warpgroup attention that ``ws_attention`` supersedes), which the local candidates time. Fused GEMMs stay:
# their tiles differ from their ``rate_kernel``'s, and on one device they time apart from it; those that run one
# program there (``FusedKernel.one_device``) share a ``program_key``, so the prune stage compiles one of them.
ONE_DEVICE_RING = ("one device: a ring attention's ring is empty there, its compute a local attention's "
                   "(the local candidates time those)")


def one_device_ring(lowering: str) -> bool:
  """Whether ``lowering`` is a ring attention, pruned on a mesh of one device (``ONE_DEVICE_RING``)."""
  return registry.fused(lowering).rate_kernel == lowering


def _one_device_ring(lowering: str) -> measure.Measurement | None:
  if not one_device_ring(lowering):
    return None
  return measure.Measurement(measure.PRUNED, reason=f"{ONE_DEVICE_RING}: {lowering} not compiled")


def lowering_variants(lowering: str, mesh, training: bool) -> list[dict]:
  """The configurations a fused kernel is offered with: its defaults, and in training each other choice of its
  configuration's ``backward`` field (the forward is the same kernel; only the backward differs) whose kernel is
  trusted on ``mesh``'s devices (``Kernel.unverified``; interpret mode tries it)."""
  if not training:
    return [{}]
  choices = configs.choices(registry.fused(lowering).config).get("backward", ())
  trusted = lambda k: registry.local(k).unverified is None or registry.local(k).interprets(mesh)
  return [{}] + [{"backward": b} for b in choices[1:] if trusted(b)]


def grouped_gemm_variants(schedule) -> list:
  """A dispatched schedule with each grouped GEMM (``analysis.dispatch.gemms()``), its own first, rebuilt through
  the primitives from its trace. A grouped GEMM kernel is offered where the mesh's devices run it and it computes
  at least one of the expert FFN's projections (elsewhere it would be ``ragged_dot`` again)."""
  data = json.loads(schedule.to_json())
  step = next(st for st in data["steps"] if st["primitive"] == "dispatch")
  own = step["kwargs"].get("gemm", "ragged_dot")
  out = [schedule.copy()]
  for gemm in dispatches.gemms():
    if gemm == own or dispatches.gemm_problem(gemm, schedule.mesh) is not None:
      continue
    step["kwargs"]["gemm"] = gemm
    variant = Schedule.from_json(schedule.program, schedule.mesh, json.dumps(data))
    d = dispatches.of(variant)
    if gemm in dispatches.BUILTIN_GEMMS or len(dispatches.gemm_fallback(variant, d)) < len(
        dispatches.projections(variant, d)):
      out.append(variant)
  return out


def _fused_lowerings(schedule, in_shardings, out_sharding) -> list[str]:
  """The fused kernels the tuner offers for ``schedule`` (compiled for the caller's layouts)."""
  names = [n for n in placements.offered(schedule)
           if registry.interpreting() or not placements.interprets(registry.fused(n), schedule)]
  if names and (in_shardings is not None or out_sharding is not None):
    try:
      laid = schedule.with_layouts(in_shardings, out_sharding)
    except ScheduleError:
      return []
    names = [n for n in names if placements.why_not(registry.fused(n), laid) is None]
  return names
