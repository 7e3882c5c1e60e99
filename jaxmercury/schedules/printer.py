"""``str(schedule)``: the annotated loop nest, with the communication it implies."""

from __future__ import annotations

from jaxmercury.schedules.loops import PARALLEL, VECTOR
from jaxmercury.shard_map import reshard


def _layout(buf, layout) -> str:
  parts = []
  for a, lv in zip(buf.axes, layout):
    parts.append(f"{a}@{'*'.join(lv)}" if lv else a)
  return "[" + ", ".join(parts) + "]"


def _moves(buf, src, dst) -> list[str]:
  out = []
  for st in reshard.steps(src, dst):
    if st.op == reshard.ALL_TO_ALL:
      out.append(f"AllToAll({buf.name} over {st.level}: {buf.axes[st.to_dim]} -> {buf.axes[st.dim]} gathered)")
    elif st.op == reshard.ALL_GATHER:
      out.append(f"AllGather({buf.name} over {st.level} along {buf.axes[st.dim]})")
    else:
      out.append(f"Slice({buf.name} at rank of {st.level} along {buf.axes[st.dim]})")
  return out


def communication(schedule, plan) -> list[str]:
  """One line per communication the lowering emits, in program order."""
  prog = schedule.program
  lines = []
  for b in prog.reads:
    lines += _moves(b, plan.storage[b.name], plan.resident[b.name])
  for ring in plan.rings.values():
    if ring.buffers:
      what = ", ".join(ring.buffers)
      lines.append(f"Ring({what} over {ring.level} at loop {ring.loop}, ppermute overlapped)")
    if ring.travel:
      lines.append(f"Ring(partial {prog.writes.name} over {ring.level} at loop {ring.loop}, to its owner)")
  red = prog.reduction.name if prog.reduction else "sum"
  for r in plan.reductions:
    if r.scatter_axis:
      lines.append(f"ReduceScatter({prog.writes.name} over {r.level} along {r.scatter_axis}, {red})")
    else:
      lines.append(f"AllReduce({prog.writes.name} over {r.level}, {red})")
  lines += _moves(prog.writes, plan.result, plan.storage[prog.writes.name])
  return lines


def render(schedule) -> str:
  prog = schedule.program
  plan = schedule.plan()
  mesh = ", ".join(f"{k}={v}" for k, v in schedule.levels.items())
  out = [f"{prog.name} on mesh ({mesh})"]
  if any(schedule.padded[a] != prog.axes[a].extent for a in schedule.padded):
    out.append("padded: " + ", ".join(f"{a} {prog.axes[a].extent}->{e}" for a, e in schedule.padded.items()
                                      if e != prog.axes[a].extent))
  if schedule.zigzags:
    out.append("zigzag order: " + ", ".join(f"{a} in {c} chunks" for a, c in schedule.zigzags.items()))
  out.append("buffers:")
  for b in prog.reads + (prog.writes,):
    role = "out" if b is prog.writes else "in "
    out.append(f"  {role} {b.name}{_layout(b, plan.storage[b.name])} {b.dtype}")
  comm = communication(schedule, plan)
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
    out.append(f"{'  ' * depth + head:<64}# {tag}")
    depth += 1
  kernel = schedule.kernel or "xla"
  block = " ".join(vector) or "scalar"
  out.append("  " * depth + f"block {block}: {prog.statement or prog.name}  [kernel {kernel}]")
  if schedule.lowering is not None:
    from jaxmercury.shard_map import fused
    out.append(fused.summary(schedule))
  return "\n".join(out)
