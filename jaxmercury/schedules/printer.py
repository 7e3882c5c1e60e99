"""``str(schedule)``: the annotated loop nest, with the communication it implies."""

from __future__ import annotations

from jaxmercury.analysis import collectives as cl
from jaxmercury.analysis import dispatch as dispatches
from jaxmercury.analysis import placements
from jaxmercury.errors import ScheduleError
from jaxmercury.ir.loops import PARALLEL, VECTOR
from jaxmercury.kernels import config as configs
from jaxmercury.kernels import registry
from jaxmercury.programs.masks import mask_of


def _layout(buf, layout) -> str:
  parts = []
  for a, lv in zip(buf.axes, layout):
    parts.append(f"{a}@{'*'.join(lv)}" if lv else a)
  return "[" + ", ".join(parts) + "]"


def collective_text(buf, c: cl.Collective, reduction: str = "sum") -> str:
  """One collective on ``buf`` (over its canonical axes) as the printout shows it."""
  axes = buf.axes
  if c.kind == cl.ALL_TO_ALL:
    return f"AllToAll({buf.name} over {c.level}: {axes[c.to_dim]} -> {axes[c.dim]} gathered)"
  if c.kind == cl.ALL_GATHER:
    return f"AllGather({buf.name} over {c.level} along {axes[c.dim]})"
  if c.kind == cl.SLICE:
    return f"Slice({buf.name} at rank of {c.level} along {axes[c.dim]})"
  if c.kind == cl.REDUCE_SCATTER:
    return f"ReduceScatter({buf.name} over {c.level} along {axes[c.dim]}, {reduction})"
  if c.kind == cl.ALL_REDUCE:
    return f"AllReduce({buf.name} over {c.level}, {reduction})"
  return f"{c.describe(axes)} of {buf.name}"


def communication(schedule, plan, run=None) -> list[str]:
  """One line per communication the lowering emits, in program order (``run``: an ``analysis.packed.DataRun``,
  whose steps data-decided rings run)."""
  prog = schedule.program
  red = prog.reduction.name if prog.reduction else "sum"
  out = prog.writes
  lines = []
  for b in prog.reads:
    lines += [collective_text(b, c) for c in cl.steps(plan.storage[b.name], plan.resident[b.name])]
  for ring in plan.rings.values():
    steps = f", {ring.size - ring.skipped} of {ring.size} steps" if ring.skipped else ""
    if ring.chain is not None:
      steps = (f", {len(run.steps[ring.loop])} of {ring.size} steps for these segment ids" if run else
               f", at most {len(ring.chain)} of {ring.size} steps: those the segment ids need")
    if ring.buffers:
      what = ", ".join(ring.buffers)
      lines.append(f"Ring({what} over {ring.level} at loop {ring.loop}, ppermute overlapped{steps})")
    if ring.travel:
      lines.append(f"Ring(partial {out.name} over {ring.level} at loop {ring.loop}, to its owner{steps})")
  lines += [collective_text(out, c, red) for c in cl.reductions(plan.resident[out.name], plan.result)]
  lines += [collective_text(out, c) for c in cl.steps(plan.result, plan.storage[out.name])]
  try:
    d = dispatches.of(schedule, plan)
  except ScheduleError as e:
    return lines + [f"(dense: the dispatch is not complete yet: {e})"]
  return lines if d is None else routed_communication(schedule, d, lines)


def routed_communication(schedule, d, dense: list[str]) -> list[str]:
  """A dispatched schedule's lines: the dense plan's gather of the tokens and scatter of the output over the
  experts' level replaced by the routed exchange (``analysis.dispatch``)."""
  routing = schedule.program.routing
  moved = {f"AllGather({name} over {d.level} along {routing.tokens})" for name in routing.routed}
  moved.add(f"ReduceScatter({schedule.program.writes.name} over {d.level} along {routing.tokens}, sum)")
  kept = [line for line in dense if line not in moved]
  split = next((k for k, line in enumerate(kept) if line.startswith(("ReduceScatter", "AllReduce"))), len(kept))
  routed = ", ".join(routing.routed)
  lines = []
  if routing.capacity is not None:  # first: the devices route their own tokens
    lines.append(f"AllGather(expert counts over {'*'.join(d.token_levels)}: capacity {routing.capacity} "
                 f"in token order)")
  lines += kept[:split]
  chunks = f", {d.chunks} chunks" if d.chunks > 1 else ""
  lines.append(f"AllToAll({routed} rows over {d.level}: dispatch to the top-{routing.top_k} experts' devices, "
               f"{d.exchange}{chunks})")
  lines.append(f"AllToAll(expert outputs over {d.level}: combine at their tokens{chunks})")
  return lines + kept[split:]


def fused_summary(schedule) -> str:
  """The printout's line for a schedule lowered with a fused kernel."""
  k = registry.fused(schedule.lowering)
  p = placements.of(schedule)
  level = p.level if not isinstance(p, str) else "?"
  mode = " (Mosaic GPU interpret mode)" if placements.interprets(k, schedule) else ""
  own = getattr(schedule.lowering_config, "backward", None)
  gradients = k.backward.description + (f", on {own}'s backward blocks" if own else "")
  return (f"lowered with {k.label(schedule.lowering_config)}{mode}: the whole nest runs as one fused kernel per "
          f"device, the ring over {level} inside it; gradients: {gradients}\n  {k.description}")


def _step_list(steps) -> str:
  """Steps, as ``0, 6-7``."""
  runs = []
  for t in steps:
    if runs and runs[-1][1] == t - 1:
      runs[-1][1] = t
    else:
      runs.append([t, t])
  return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def render(schedule, run=None) -> str:
  """The printout; ``run``: an ``analysis.packed.DataRun`` of some segment ids, whose counts it shows."""
  prog = schedule.program
  plan = schedule.plan()
  mesh = ", ".join(f"{k}={v}" for k, v in schedule.levels.items())
  out = [f"{prog.name} on mesh ({mesh})"]
  if any(schedule.padded[a] != prog.axes[a].extent for a in schedule.padded):
    out.append("padded: " + ", ".join(f"{a} {prog.axes[a].extent}->{e}" for a, e in schedule.padded.items()
                                      if e != prog.axes[a].extent))
  if schedule.balanced:
    out.append(f"balanced order: each row's segments spread evenly over {schedule.zigzags['i']} chunks (from the "
               "segment ids, when running), then zigzag order")
  elif schedule.zigzags:
    out.append("zigzag order: " + ", ".join(f"{a} in {c} chunks" for a, c in schedule.zigzags.items()))
  out.append("buffers:")
  for b in prog.reads + (prog.writes,):
    role = "out" if b is prog.writes else "in "
    out.append(f"  {role} {b.name}{_layout(b, plan.storage[b.name])} {b.dtype}")
  comm = communication(schedule, plan, run)
  out.append("communication:" + ("" if comm else " none"))
  out += [f"  {c}" for c in comm]
  out.append("loop nest:")
  depth = 1
  vector = []
  for lp in schedule.loops:
    if lp.role == VECTOR:
      vector.append(f"{lp.name}:{lp.extent}")
      continue
    tag = "spatial" if lp.kind == "s" else "reduction"
    if lp.role == PARALLEL:
      head = f"parallel {lp.name} in {lp.extent} @ {lp.level}"
    else:
      head = f"for {lp.name} in {lp.extent}"
      if lp.shifted_by:
        ring = plan.rings[lp.name]
        head += f"  shift({lp.shifted_by}): visits ({lp.name} + rank {ring.level}"
        head += f" + 1) % {lp.extent}" if ring.offset else f") % {lp.extent}"
        if ring.skipped and ring.chain is None:
          where = "window" if mask_of(prog.params).window is not None else "mask"
          head += f"; skips {ring.skipped} of {lp.extent} steps outside the {where} (runs {_step_list(ring.steps())})"
        if ring.chain is not None:
          head += _data_steps(ring, run)
    line = "  " * depth + head
    out.append(f"{line:<64}# {tag}" if len(line) < 64 else f"{line}  # {tag}")
    depth += 1
  kernel = configs.label(schedule.kernel, schedule.kernel_config) if schedule.kernel else "xla"
  if schedule.dispatched:
    kernel = f"routed rows, grouped by expert: {schedule.dispatched['gemm']}"
    try:
      fallback = dispatches.gemm_fallback(schedule, dispatches.of(schedule, plan, complete=False))
    except ScheduleError:
      fallback = {}
    if fallback:
      kernel += "; " + "; ".join(f"{name} projection on ragged_dot: {why}" for name, why in fallback.items())
  block = " ".join(vector) or "scalar"
  out.append("  " * depth + f"block {block}: {prog.statement or prog.name}  [kernel {kernel}]")
  if schedule.lowering is not None:
    out.append(fused_summary(schedule))
  if run is not None:
    out.append(f"for these segment ids: blocks computed per device {list(run.calls)}, kept pairs per device "
               f"{list(run.pairs)} (busiest {run.balance():.2f}x the mean)")
  return "\n".join(out)


def _data_steps(ring, run) -> str:
  """The loop line's note on a ring whose steps the segment ids decide."""
  chain = ", ".join(map(str, ring.chain_steps()))
  if run is None:
    return f"; runs the steps its segment ids keep pairs at, as far along {chain} as needed"
  kept, steps = run.kept_steps[ring.loop], run.steps[ring.loop]
  return (f"; for these segment ids: pairs kept at {len(kept)} of {ring.size} steps, runs {len(steps)} "
          f"({_step_list(sorted(steps))}) of {chain}")
