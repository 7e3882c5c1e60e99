"""One Llama-3 decoder block: jaxmercury's graph-level plans against XLA partitioning the same block.

The plans come from ``jaxmercury.graph.search`` over the block's DAG (``models.block_graph``): every GEMM and the
attention pick a library schedule, every edge the resharding between them. One plan is searched per residual
layout (sequence-split, replicated) and objective (the forward, or a training step); with ``--measure_iters N``
every operator candidate is timed on the mesh first and the search uses those times. The cost-model figures are
measured on the mesh per sequence length (``--machines calibrated``, the GPU default), or the reference H200
figures below. The baselines are the same block as one plain function (``models.block_graph.block_apply``) under
``jax.jit`` with sharded parameters and input, partitioned by XLA: Megatron tensor parallelism with a replicated or
a sequence-split residual, and pure sequence parallelism; each constrains q, k and v to a head split before
attention, as a Megatron user would.

Per sequence length, two cases: the forward, and the training step (the gradients of the input and every
parameter for a random cotangent), every output and gradient checked against the block on one device. ``--split``
adds each operator of the fastest plan timed alone beside XLA partitioning the same operator in the same layouts
(Mercury's Fig. 12). ``--reprice FILES`` prices the plans those results files timed with the current cost model,
beside their measured times (CPU: nothing runs).
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import harness
from benchmarks.cases import size_label
from jaxmercury import graph as jg
from jaxmercury import programs
from jaxmercury.analysis.layouts import Layout
from jaxmercury.graph.dag import OP
from jaxmercury.tuner import calibrate, measure
from jaxmercury.tuner.cost import Machine
from models import CONFIGS, DecoderBlock
from models import block_graph as bg

# Figures measured on the 2 x H200 NVLink machine: bf16 GEMM ~600 TFLOP/s, cuDNN attention ~550 TFLOP/s, ring
# transfers ~150 GB/s at 256 MiB, elementwise 2.2 TB/s.
_LINKS = {"*": 150e9}
H200_MACHINES = {
    "matmul": Machine("H200 GEMM (reference figures)", 600e12, _LINKS, 20e-6, {"xla": 600e12},
                      memory_bytes_per_s=2.2e12),
    "attention": Machine("H200 cuDNN attention (reference figures)", 550e12, _LINKS, 20e-6,
                         {"cudnn_attention": 550e12}, memory_bytes_per_s=2.2e12),
    "*": Machine("H200 NVLink (reference figures)", 600e12, _LINKS, 20e-6, memory_bytes_per_s=2.2e12),
}
CPU_MACHINES = {"*": Machine("simulated CPU devices", 20e9, {"*": 5e9}, 50e-6, memory_bytes_per_s=10e9)}
# Library strategies on GPUs: those whose blocks cuDNN takes whole (blocks of unequal query and key sizes fall back
# to the XLA body under a causal mask, which holds the scores).
GPU_STRATEGIES = ("ring", "ulysses", "allgather_matmul", "matmul_reducescatter", "async_tp", "async_tp_reducescatter",
                  "data_parallel")
COLUMN, ROW = ("wq", "wk", "wv", "w_gate", "w_up"), ("wo", "w_down")
BASELINES = {"xla_megatron_tp": ({**dict.fromkeys(COLUMN, P(None, "x")), **dict.fromkeys(ROW, P("x", None))}, P()),
             "xla_megatron_tp_sp": ({**dict.fromkeys(COLUMN, P(None, "x")), **dict.fromkeys(ROW, P("x", None))},
                                    P(None, "x", None)),
             "xla_sequence_parallel": ({}, P(None, "x", None))}  # parameter specs, residual spec
RESIDUALS = {"sequence": P(None, "x", None), "replicated": P()}
# The plans searched: per residual layout and objective.
PLANS = {"jaxmercury_plan": ("sequence", False), "jaxmercury_plan_replicated": ("replicated", False),
         "jaxmercury_plan_training": ("sequence", True), "jaxmercury_plan_replicated_training": ("replicated", True)}
TOLERANCE = 5e-2  # a bf16 block's output and gradients against the block on one device


@dataclasses.dataclass(frozen=True)
class BlockCase:
  seq: int
  config: str

  @property
  def name(self) -> str:
    return f"llama {self.config} block S{size_label(self.seq)}"

  @property
  def flops(self) -> float:
    c = CONFIGS[self.config]
    return 2.0 * self.seq * (4 * c.dim * c.heads * c.head_dim + 3 * c.dim * c.hidden) + 4.0 * self.seq ** 2 * c.dim


def plan(args) -> list[BlockCase]:
  if args.smoke:
    return [BlockCase(128, "tiny")]
  return [BlockCase(s, args.config) for s in (args.seqs or (4096, 16384))]


class Env:
  def __init__(self, args, results: dict, deadline: float):
    self.args, self.results, self.deadline = args, results, deadline
    self.mesh = jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(AxisType.Auto,))
    self.gpu = jax.devices()[0].platform == "gpu"
    self.impl = "cudnn" if self.gpu else None
    self.calibrated = (args.machines or ("calibrated" if self.gpu and not args.smoke else "reference")) == "calibrated"


def residual_layout(kind: str, mesh) -> Layout:
  return bg.sequence_parallel(mesh) if kind == "sequence" else Layout.replicated(2)


def machines_of(env, config, seq: int) -> dict:
  """Cost-model figures by program pattern: calibrated on the mesh for this block, or the reference ones.

  A ``[seq, dim] x [dim, dim]`` GEMM gives the GEMM rate, links, latency, overlap and memory bandwidth (and on
  GPUs each fused GEMM's rate); the block's causal attention gives the attention kernel's rate (and on GPUs the
  fused ring attentions').
  """
  if not env.calibrated:
    return H200_MACHINES if env.gpu else CPU_MACHINES
  kernel = "cudnn_attention" if env.gpu else "xla"
  gemm_program = programs.matmul(seq, config.dim, config.dim, dtype=config.dtype)
  gemm = calibrate.calibrate(gemm_program, env.mesh, kernels=["xla"])
  gemm = dataclasses.replace(gemm, fused_flops_per_s=calibrate.fused_gemm_rates(gemm_program, env.mesh)
                             if env.gpu else {})
  attention = programs.attention(1, config.heads, config.kv_heads, seq, seq, config.head_dim, causal=True,
                                 dtype=config.dtype)
  rates, overhead = calibrate.kernel_rates(attention, env.mesh, [kernel])
  return {"matmul": gemm, "*": gemm, "attention": dataclasses.replace(
      gemm, name=f"{gemm.name}, {kernel}", kernel_flops_per_s=rates, flops_per_s=rates[kernel],
      call_overhead_s=overhead, fused_flops_per_s=calibrate.fused_rates(attention, env.mesh) if env.gpu else {})}


def search(env, config, seq: int, machines) -> dict:
  """``{plan name: {"plan", "search_s", "same_as"}}``: the plans of ``PLANS``; a training plan choosing what its
  layout's forward plan chose is ``same_as`` it (and timed once)."""
  out, measured = {}, {}
  strategies = GPU_STRATEGIES if env.gpu and not env.args.smoke else None
  for name, (residual, training) in PLANS.items():
    t0 = time.perf_counter()
    graph = bg.block_graph(config, batch=1, seq=seq, mesh=env.mesh, machines=machines, strategies=strategies,
                           residual=residual_layout(residual, env.mesh))
    if env.args.measure_iters:
      graph = jg.measure_candidates(graph, machines, iters=env.args.measure_iters, cache=measured, training=training,
                                    log=harness.log)
    found = jg.search(graph, machines, training=training)
    twin = next((n for n, (r, t) in PLANS.items() if r == residual and not t), None) if training else None
    same = twin and {k: c.name for k, c in out[twin]["plan"].choice.items()} == \
        {k: c.name for k, c in found.choice.items()}
    out[name] = {"plan": found, "search_s": time.perf_counter() - t0, "same_as": twin if same else None}
    harness.log(f"{name}:\n{found}")
  return out


def _block(env, f, param_specs: dict, x_spec, data: dict, training: bool, device=None):
  """A builder of ``f(params, x)`` jitted for its layouts, its arguments placed so (``device``: all on that one)."""
  def build():
    shard = (lambda s: NamedSharding(env.mesh, s)) if device is None else \
        (lambda s: jax.sharding.SingleDeviceSharding(device))
    params = {k: jax.device_put(v, shard(param_specs.get(k, P()))) for k, v in data["params"].items()}
    args = (params, jax.device_put(data["x"], shard(x_spec)))
    if training:
      return measure.training_step(f), (*args, jax.device_put(data["cot"], shard(x_spec)))
    return jax.jit(f, out_shardings=shard(x_spec)), args
  return build


def run_case(env, case: BlockCase) -> list[dict]:
  """The forward and the training step of every plan and baseline; with ``--split``, every operator alone."""
  config = CONFIGS[case.config].with_dtype(jnp.bfloat16)
  machines = machines_of(env, config, case.seq)
  plans = search(env, config, case.seq, machines)
  seed = env.args.seed
  kx, kc = jax.random.split(jax.random.key(seed + 1))
  data = {"params": bg.block_params(DecoderBlock(config, rngs=nnx.Rngs(seed))),
          "x": jax.random.normal(kx, (1, case.seq, config.dim), config.dtype)}
  data["cot"] = jax.random.normal(kc, data["x"].shape, config.dtype)
  info = {"seq": case.seq, "config": case.config, "machines": {k: m.to_dict() for k, m in machines.items()},
          "plans": {name: {"residual": PLANS[name][0], "training": PLANS[name][1], "same_as": p["same_as"],
                           "plan": str(p["plan"]), "predicted_ms": p["plan"].seconds * 1e3, "search_s": p["search_s"],
                           "choice": {n: c.name for n, c in p["plan"].choice.items()}} for name, p in plans.items()}}
  heads = NamedSharding(env.mesh, P(None, None, "x", None))  # what a Megatron user constrains attention to
  split_fn = lambda p, x: bg.block_apply(p, x, config, implementation=env.impl, attention_sharding=heads)
  one_fn = lambda p, x: bg.block_apply(p, x, config, implementation=env.impl)
  out = []
  for training in (False, True):
    contestants = [harness.Contestant("one_device", "reference", _block(env, one_fn, {}, P(), data, training,
                                                                        jax.devices()[0]), "the block on one device")]
    for name, p in plans.items():
      if p["same_as"] is None:
        f, specs = bg.planned_block(p["plan"])
        contestants.append(harness.Contestant(name, "jaxmercury", _block(env, f, specs, RESIDUALS[PLANS[name][0]], data,
                                                                         training), "jaxmercury's graph plan"))
    contestants += [harness.Contestant(name, "baseline", _block(env, split_fn, specs, x_spec, data, training),
                                       "the block under jax.jit, partitioned by XLA")
                    for name, (specs, x_spec) in BASELINES.items()]
    group = "training" if training else "forward"
    rec = {"name": f"{case.name} {group}", "group": group, **info}
    settings = harness.Settings.from_args(env.args, env.deadline, TOLERANCE)
    out.append(harness.finish(rec, *harness.run_contestants(contestants, [], settings)))
  if env.args.split:
    timed = [r for r in out[1]["contestants"] if r["role"] == "jaxmercury" and "median_ms" in r]
    if timed:
      out += split(env, case, plans[min(timed, key=lambda r: r["median_ms"])["name"]]["plan"])
  return out


def _same_op_by_xla(program, implementation):
  """The operator as one plain function for XLA to partition (attention through ``dot_product_attention``)."""
  if program.pattern == "attention":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=program.params["causal"],
                                                        implementation=implementation)
  return program.reference


def split(env, case, found) -> list[dict]:
  """Each operator of plan ``found`` timed alone beside XLA partitioning it, in the plan's layouts, both passes."""
  out, seen = [], set()
  for node in found.graph.nodes:
    schedule = found.choice[node.name].schedule if node.kind == OP else None
    if schedule is None or (key := (str(schedule), tuple(b.shape for b in schedule.program.reads))) in seen:
      continue  # glue, or an operator timed already (w_gate and w_up)
    seen.add(key)
    prog = schedule.program
    ins = [NamedSharding(env.mesh, s if s is not None else P()) for s in schedule.in_shardings]
    out_sharding = NamedSharding(env.mesh, schedule.out_sharding if schedule.out_sharding is not None else P())
    keys = jax.random.split(jax.random.fold_in(jax.random.key(env.args.seed), len(seen)), len(ins) + 1)
    xs = [harness.random_array(k, b.shape, b.dtype, s) for k, b, s in zip(keys, prog.reads, ins)]
    cot = harness.random_array(keys[-1], prog.writes.shape, prog.writes.dtype, out_sharding)
    for group in ("forward", "training"):
      training = group == "training"
      xla = jax.jit(_same_op_by_xla(prog, env.impl), in_shardings=ins, out_shardings=out_sharding)
      sides = [("xla", "baseline", xla), ("jaxmercury", "jaxmercury", schedule.compile())]
      contestants = [harness.Contestant(side, role, (lambda f=f: measure.training_step(f)) if training else
                                        (lambda f=f: f), found.choice[node.name].name if side == "jaxmercury" else "")
                     for side, role, f in sides]
      settings = harness.Settings.from_args(env.args, env.deadline, TOLERANCE)
      rec = {"name": f"{case.name} {node.name} {group}", "group": f"operators {group}", "operator": node.name}
      out.append(harness.finish(rec, *harness.run_contestants(contestants, [*xs, cot] if training else xs, settings)))
  return out


# ------------------------------------------------------------------ the cost model against recorded runs


def _timed_plans(data: dict) -> dict:
  """Per sequence length of a results file: its plans, figures and each contestant's forward and training ms
  (this suite's files, or the earlier ``llama_block`` script's, which held both times in one record)."""
  out = {}
  for case in data.get("cases", []):
    if "plans" not in case:
      continue
    entry = out.setdefault(case["seq"], {"plans": case["plans"], "machines": case.get("machines"), "times": {}})
    for r in case.get("contestants", []):
      fwd, train = entry["times"].get(r["name"], (None, None))
      if "forward_ms" in r:
        fwd, train = r["forward_ms"], r["forward_backward_ms"]
      elif "median_ms" in r:
        fwd, train = (fwd, r["median_ms"]) if case["group"] == "training" else (r["median_ms"], train)
      entry["times"][r["name"]] = (fwd, train)
  return out


def reprice(args) -> int:
  """The plans recorded files timed, rebuilt from their choices and figures and priced by the current cost model."""
  config = CONFIGS[args.config].with_dtype(jnp.bfloat16)
  rows = []
  for path in args.reprice:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    mesh = AbstractMesh((data["n_devices"],), ("x",), axis_types=(AxisType.Auto,))
    for seq, entry in _timed_plans(data).items():
      if not entry["machines"]:
        raise SystemExit(f"{path}, seq {seq}: no calibrated figures recorded")
      machines = {k: Machine.from_dict(m) for k, m in entry["machines"].items()}
      for name, recorded in entry["plans"].items():
        fwd, train = entry["times"].get(recorded["same_as"] or name, (None, None))
        if fwd is None or train is None:
          continue
        graph = bg.block_graph(config, batch=1, seq=seq, mesh=mesh, machines=machines, strategies=GPU_STRATEGIES,
                               residual=residual_layout(recorded["residual"], mesh))
        options = {node.name: {c.name: c for c in node.candidates} for node in graph.nodes}
        if missing := sorted(n for n, c in recorded["choice"].items() if c not in options.get(n, {})):
          raise SystemExit(f"{path}, seq {seq}, {name}: the graph no longer offers the recorded choices of {missing}")
        choice = {n: options[n][c] for n, c in recorded["choice"].items()}
        rows.append({"results": path, "seq": seq, "plan": name, "forward_measured_ms": fwd,
                     "training_measured_ms": train,
                     "forward_predicted_ms": jg.fixed(graph, machines, choice).seconds * 1e3,
                     "training_predicted_ms": jg.fixed(graph, machines, choice, training=True).seconds * 1e3})
        harness.log(f"{path} S{seq} {name}: forward {rows[-1]['forward_predicted_ms'] / fwd:.2f}, training "
                    f"{rows[-1]['training_predicted_ms'] / train:.2f} of measured")
  harness.write_json(args.out, {**harness.header("llama", args.argv),
                                "note": "predictions of recorded GPU runs, computed here; the times are theirs",
                                "rows": rows})
  harness.log(f"wrote {args.out}")
  return 0
