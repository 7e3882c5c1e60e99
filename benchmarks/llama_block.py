"""One Llama-3 8B-sized decoder block: jaxmercury's graph-level plan against XLA partitioning the same block.

The plan comes from ``jaxmercury.graph.search`` over the block's DAG
(``models.block_graph``): every GEMM and the attention pick a library
schedule, every edge the fused resharding between them; with
``--measure_iters N`` every operator candidate is first timed on the mesh
and the search uses those times instead of the cost model's. One plan is
searched per residual-stream layout (sequence-split and replicated) and per
objective (the forward alone, or a training step). The baselines are the
same block as one plain function (``models.block_graph.block_apply``) under
``jax.jit`` with sharded parameters and input, partitioned by XLA itself:
Megatron tensor parallelism (column-split q/k/v/gate/up, row-split o/down)
with a replicated or a sequence-split residual, and pure sequence
parallelism (replicated weights); each constrains q, k and v to a head split
before attention, as cuDNN's partitioner takes no sequence split (XLA moves
the sequence split to heads by itself, an all-to-all). Forward and forward+backward (gradients of
the input and every parameter) are timed, medians of ``--iters`` runs on
fresh random inputs, and every output and gradient is compared with the
block on one device. Then each operator of the plan is timed alone, beside
XLA partitioning the same operator in the same layouts (``operator_split``,
the per-operator split of Mercury's Fig. 12; ``--no_split`` skips it), so the
block's gap to a baseline can be traced to operators and edges.

  python -m benchmarks.llama_block --out results.json [--smoke] [--seq 4096 16384] [--iters 10]
      [--baselines xla_megatron_tp xla_megatron_tp_sp xla_sequence_parallel] [--config llama3_8b]
      [--machines calibrated|reference] [--measure_iters N]

``--smoke``: the tiny configuration on 2 simulated CPU devices, sequence 128.
On GPUs the plan is searched over the attention strategies whose blocks
cuDNN takes whole and, where they run, the fused collective-GEMM and
ring-attention kernels (``<lowering>`` candidates); its cost-model figures
are measured on the mesh before each sequence length (``--machines
calibrated``, the GPU default: the GEMM rate, link, latency and ring
overlap from a GEMM of the block's size, the attention kernel's rate from
its blocks) or taken from the reference H200 figures below
(``--machines reference``, the CPU default).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import harness  # noqa: E402
from jaxmercury import graph as jg  # noqa: E402
from jaxmercury.graph.dag import OP  # noqa: E402
from jaxmercury.analysis.layouts import Layout  # noqa: E402
from jaxmercury import programs  # noqa: E402
from jaxmercury.tuner import calibrate  # noqa: E402
from jaxmercury.tuner.cost import Machine  # noqa: E402
from models import CONFIGS, DecoderBlock  # noqa: E402
from models import block_graph as bg  # noqa: E402

# Figures measured on the 2 x H200 NVLink machine (shared/REFERENCE.md): bf16 GEMM 609 TFLOP/s, cuDNN
# attention ~550 TFLOP/s, ring transfers ~150 GB/s at 256 MiB, elementwise 2.2 TB/s.
_H200_LINKS = {"*": 150e9}
H200_MACHINES = {
    "matmul": Machine("H200 GEMM (reference figures)", 600e12, _H200_LINKS, 20e-6, {"xla": 600e12},
                      memory_bytes_per_s=2.2e12),
    "attention": Machine("H200 cuDNN attention (reference figures)", 550e12, _H200_LINKS, 20e-6,
                         {"cudnn_attention": 550e12}, memory_bytes_per_s=2.2e12),
    "*": Machine("H200 NVLink (reference figures)", 600e12, _H200_LINKS, 20e-6, memory_bytes_per_s=2.2e12),
}
CPU_MACHINES = {"*": Machine("simulated CPU devices", 20e9, {"*": 5e9}, 50e-6, memory_bytes_per_s=10e9)}


def calibrated_machines(config, seq: int, mesh, attention_kernel: str) -> dict:
  """Cost-model figures measured on ``mesh`` for one block (batch 1, ``seq`` tokens), by program pattern.

  A ``[seq, dim] x [dim, dim]`` GEMM gives the GEMM rate, every level's
  link, the latency, the all-gather factor, the ring overlap and the memory
  bandwidth (``calibrate.calibrate``), and on GPUs each fused GEMM's rate on
  the mesh (``calibrate.fused_gemm_rates``); the block's causal attention
  gives ``attention_kernel``'s rate on its own blocks and, on GPUs, the fused
  ring attentions' (``calibrate.fused_rates``).
  """
  c = config
  gpu = mesh.devices.flat[0].platform == "gpu"
  gemm_program = programs.matmul(seq, c.dim, c.dim, dtype=c.dtype)
  gemm = calibrate.calibrate(gemm_program, mesh, kernels=["xla"])
  gemm = dataclasses.replace(gemm, fused_flops_per_s=calibrate.fused_gemm_rates(gemm_program, mesh) if gpu else {})
  attention = programs.attention(1, c.heads, c.kv_heads, seq, seq, c.head_dim, causal=True, dtype=c.dtype)
  rates, overhead = calibrate.kernel_rates(attention, mesh, [attention_kernel])
  attention_machine = dataclasses.replace(gemm, name=f"{gemm.name}, {attention_kernel}", kernel_flops_per_s=rates,
                                          flops_per_s=rates[attention_kernel], call_overhead_s=overhead,
                                          fused_flops_per_s=calibrate.fused_rates(attention, mesh) if gpu else {})
  return {"matmul": gemm, "attention": attention_machine, "*": gemm}


# Library strategies on GPU: blocks of unequal query/key sizes (context_parallel, tree) fall back to the XLA
# attention body under a causal mask, which materializes the scores at these lengths.
GPU_STRATEGIES = ("ring", "ulysses", "allgather_matmul", "matmul_reducescatter", "async_tp",
                  "async_tp_reducescatter", "data_parallel")

COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")


def baseline_layouts(name: str) -> tuple[dict, P]:
  """Parameter specs and the residual spec of a plain-jit baseline."""
  seq = P(None, "x", None)
  if name == "xla_megatron_tp":
    return {**{k: P(None, "x") for k in COLUMN}, **{k: P("x", None) for k in ROW}}, P()
  if name == "xla_megatron_tp_sp":
    return {**{k: P(None, "x") for k in COLUMN}, **{k: P("x", None) for k in ROW}}, seq
  if name == "xla_sequence_parallel":
    return {}, seq
  raise ValueError(f"unknown baseline {name!r}")


BASELINES = ("xla_megatron_tp", "xla_megatron_tp_sp", "xla_sequence_parallel")


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def place(tree: dict, mesh, specs: dict):
  return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in tree.items()}


# The residual stream's layouts the plan is searched for: tokens split (sequence parallel), or replicated
# (what Megatron tensor parallelism keeps between blocks); the block's input and output take it.
RESIDUALS = {"sequence": P(None, "x", None), "replicated": P()}
# The plans searched: per residual layout and per objective (the forward alone, or a training step: forward and
# backward, with replicated weights' gradients all-reduced; ``jaxmercury.graph.search``).
PLANS = {"jaxmercury_plan": ("sequence", False), "jaxmercury_plan_replicated": ("replicated", False),
         "jaxmercury_plan_training": ("sequence", True), "jaxmercury_plan_replicated_training": ("replicated", True)}


def residual_layout(kind: str, mesh) -> Layout:
  return bg.sequence_parallel(mesh) if kind == "sequence" else Layout.replicated(2)


def plan_block(config, seq: int, mesh, machines, strategies, residual: str = "sequence", measure_iters: int = 0,
               measured: dict | None = None, training: bool = False):
  """The searched plan of one block (batch 1) for a residual layout kind, and the seconds planning took.

  ``measure_iters > 0``: every operator candidate is first timed on the mesh
  (``jaxmercury.graph.measure_candidates``, its timings kept in ``measured``)
  and the search uses those times. ``training``: the search minimizes a
  training step's time, not the forward's (with ``measure_iters``: each
  candidate's forward and backward measured too).
  """
  t0 = time.perf_counter()
  graph = bg.block_graph(config, batch=1, seq=seq, mesh=mesh, machines=machines, strategies=strategies,
                         residual=residual_layout(residual, mesh))
  if measure_iters:
    graph = jg.measure_candidates(graph, machines, iters=measure_iters, log=lambda line: print(line, flush=True),
                                  cache=measured, training=training)
  plan = jg.search(graph, machines, training=training)
  return plan, time.perf_counter() - t0


def _same_op_by_xla(program, implementation):
  """The operator as one plain function for XLA to partition (attention through ``dot_product_attention``)."""
  if program.pattern == "attention":
    causal = program.params["causal"]
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)
  return program.reference


def operator_split(plan, iters: int, implementation, rows: list | None = None, saved=lambda: None) -> list[dict]:
  """Each operator of ``plan`` timed alone (Mercury's Fig. 12 split), beside XLA partitioning the same operator.

  Both sides get the same fresh inputs in the layouts the plan gives the
  operator and the same output layout; forward and forward+backward (the
  gradients of every input for a random cotangent) are timed. Rows are
  appended to ``rows`` as they come, and ``saved()`` is called after each.
  """
  from jax.sharding import PartitionSpec
  mesh, seen = plan.graph.mesh, {}
  rows = [] if rows is None else rows
  for node in plan.graph.nodes:
    if node.kind != OP:
      continue
    schedule = plan.choice[node.name].schedule
    prog = schedule.program
    key = (str(schedule), prog.name, tuple(b.shape for b in prog.reads))
    if key in seen:  # e.g. w_gate and w_up: one timing
      rows.append({**seen[key], "operator": node.name, "same_as": seen[key]["operator"]})
      saved()
      continue
    ins = [NamedSharding(mesh, s if s is not None else PartitionSpec()) for s in schedule.in_shardings]
    out = NamedSharding(mesh, schedule.out_sharding if schedule.out_sharding is not None else PartitionSpec())
    keys = jax.random.split(jax.random.key(random.SystemRandom().randrange(1 << 31)), len(ins) + 1)
    xs = [harness.random_array(k, b.shape, b.dtype, sh) for k, b, sh in zip(keys, prog.reads, ins)]
    cot = harness.random_array(keys[-1], prog.writes.shape, prog.writes.dtype, out)
    row = {"operator": node.name, "schedule": plan.choice[node.name].name}
    for side, f in (("jaxmercury", schedule.compile()), ("xla", _same_op_by_xla(prog, implementation))):
      fwd = jax.jit(f, in_shardings=ins, out_shardings=out)
      loss = lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * cot.astype(jnp.float32))
      both = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(xs)))), in_shardings=ins)
      try:
        row[f"{side}_forward_ms"] = harness.time_call(fwd, xs, iters=iters, max_s=30.0)
        row[f"{side}_forward_backward_ms"] = harness.time_call(both, xs, iters=iters, max_s=30.0)
      except Exception as e:  # noqa: BLE001 - record and go on
        row[f"{side}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), flush=True)
    seen[key] = row
    rows.append(row)
    saved()
  return rows


def block_contestants(plans: dict, config, mesh, baselines, implementation) -> dict:
  """``name -> (f(params, x), param specs, input spec)``: each plan (keyed by its ``PLANS`` name), then each
  plain-jit baseline (the block as one function, attention constrained to a head split)."""
  contestants = {}
  for name, plan in plans.items():
    planned, plan_specs = bg.planned_block(plan)
    contestants[name] = (planned, plan_specs, RESIDUALS[PLANS[name][0]])
  heads = NamedSharding(mesh, P(None, None, "x", None))  # what a Megatron user constrains attention to
  split_fn = lambda p, x: bg.block_apply(p, x, config, implementation=implementation, attention_sharding=heads)
  for name in baselines:
    specs, x_spec = baseline_layouts(name)
    contestants[name] = (split_fn, specs, x_spec)
  return contestants


def placed_forward(f, specs: dict, x_spec, params: dict, x, mesh):
  """``f`` jitted for parameters in ``specs`` and the input in ``x_spec``, and those arguments placed so.

  Returns:
    ``(forward, in_shardings, (placed params, placed x))``.
  """
  shardings = ({k: NamedSharding(mesh, specs.get(k, P())) for k in params}, NamedSharding(mesh, x_spec))
  fwd = jax.jit(f, in_shardings=shardings, out_shardings=shardings[1])
  return fwd, shardings, (place(params, mesh, specs), jax.device_put(x, shardings[1]))


def run_case(config, seq: int, mesh, machines, strategies, iters: int, baselines, implementation, split=True,
             case: dict | None = None, saved=lambda: None, measure_iters: int = 0) -> dict:
  """Times the plans and the baselines on one sequence length; fills ``case`` as results come, calling ``saved()``.

  One plan is searched per residual layout and objective (``PLANS``); a
  training plan that chose what the forward plan of its layout chose is not
  timed twice. jaxmercury's time is the fastest plan's, as a tuner picking
  between them by measurement would.
  """
  plans, measured, same_as = {}, {}, {}
  for name, (kind, training) in PLANS.items():
    plans[name] = plan_block(config, seq, mesh, machines, strategies, kind, measure_iters, measured, training)
    print(name, plans[name][0], sep="\n", flush=True)
    twin = next((other for other, (k, t) in PLANS.items() if k == kind and not t), None) if training else None
    if twin and {n: c.name for n, c in plans[twin][0].choice.items()} == \
            {n: c.name for n, c in plans[name][0].choice.items()}:
      same_as[name] = twin
  case = {} if case is None else case
  rows, split_rows = [], []
  case.update({"config": f"Llama block dim {config.dim} heads {config.heads} kv {config.kv_heads} head_dim "
                         f"{config.head_dim} hidden {config.hidden}, batch 1, seq {seq}, {np.dtype(config.dtype)}",
               "seq": seq, "plans": {name: {"residual": PLANS[name][0], "training": PLANS[name][1],
                                            "same_as": same_as.get(name), "plan": str(plan),
                                            "predicted_ms": plan.seconds * 1e3, "search_s": search_s,
                                            "choice": {n: c.name for n, c in plan.choice.items()}}
                                     for name, (plan, search_s) in plans.items()},
               "contestants": rows, "summary": {}, "operator_split": split_rows})
  seed = random.SystemRandom().randrange(1 << 31)
  block = DecoderBlock(config, rngs=nnx.Rngs(seed))
  params = bg.block_params(block)
  kx, kc = jax.random.split(jax.random.key(seed + 1))
  x = jax.random.normal(kx, (1, seq, config.dim), config.dtype)
  cot = jax.random.normal(kc, x.shape, config.dtype)

  def with_grad(f):
    loss = lambda p, x: jnp.sum(f(p, x).astype(jnp.float32) * cot.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 1))

  one = jax.devices()[0]
  ref_fn = lambda p, x: bg.block_apply(p, x, config, implementation=implementation)
  ref_args = (jax.device_put(params, one), jax.device_put(x, one))
  want = jax.jit(ref_fn)(*ref_args)
  _, want_grads = jax.jit(with_grad(ref_fn))(*ref_args)
  want_grads = jax.tree.leaves(want_grads)

  contestants = block_contestants({name: plan for name, (plan, _) in plans.items() if name not in same_as}, config,
                                  mesh, baselines, implementation)
  for name, (f, specs, x_spec) in contestants.items():
    row = {"name": name, "param_specs": {k: str(v) for k, v in specs.items()}, "input_spec": str(x_spec)}
    try:
      fwd, shardings, (p, xs) = placed_forward(f, specs, x_spec, params, x, mesh)
      both = jax.jit(with_grad(f), in_shardings=shardings)
      t0 = time.perf_counter()
      out = fwd(p, xs)
      _, grads = both(p, xs)
      row["compile_and_first_run_s"] = time.perf_counter() - t0
      row["out_rel_err"] = rel(out, want)
      row["grad_rel_err"] = max(rel(g, w) for g, w in zip(jax.tree.leaves(grads), want_grads))
      row["forward_ms"] = harness.time_call(fwd, (p, xs), iters=iters, max_s=120.0)
      row["forward_backward_ms"] = harness.time_call(both, (p, xs), iters=iters, max_s=120.0)
    except Exception as e:  # noqa: BLE001 - record and go on
      text = str(e)
      row["error"] = f"{type(e).__name__}: {text if len(text) < 900 else text[:300] + ' ... ' + text[-600:]}"
    print(json.dumps(row), flush=True)
    rows.append(row)
    saved()
  ok = [r for r in rows if "error" not in r and r["name"] not in PLANS]
  ours = [r for r in rows if "error" not in r and r["name"] in PLANS]
  for key in ("forward_ms", "forward_backward_ms"):
    if ok and ours:
      best, mine = min(ok, key=lambda r: r[key]), min(ours, key=lambda r: r[key])
      case["summary"][key] = {"jaxmercury": mine[key], "plan": mine["name"], "best_baseline": best["name"],
                              "best_baseline_ms": best[key], "speedup": best[key] / mine[key]}
  saved()
  if split and ours:
    fastest = min(ours, key=lambda r: r["forward_backward_ms"])["name"]
    case["operator_split_plan"] = fastest
    operator_split(plans[fastest][0], iters, implementation, rows=split_rows, saved=saved)
  return case


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--seq", type=int, nargs="*", default=[4096, 16384])
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--baselines", nargs="*", default=list(BASELINES))
  p.add_argument("--config", default="llama3_8b", choices=sorted(CONFIGS), help="block sizes (without --smoke)")
  p.add_argument("--no_split", action="store_true", help="skip timing each operator alone")
  p.add_argument("--machines", choices=("calibrated", "reference"), default=None,
                 help="cost-model figures: measured on the mesh per sequence length, or the reference ones "
                      "(default: calibrated on GPUs, reference on CPUs)")
  p.add_argument("--measure_iters", type=int, default=None,
                 help="time every operator candidate this many rounds before the search (default 0: the cost "
                      "model's predictions)")
  args = p.parse_args(argv)
  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,))
  gpu = jax.devices()[0].platform == "gpu"
  if args.smoke:
    config = CONFIGS["tiny"].with_dtype(jnp.bfloat16)
    seqs, iters, machines, strategies = [128], min(args.iters, 3), CPU_MACHINES, None
  else:
    config = CONFIGS[args.config].with_dtype(jnp.bfloat16)
    seqs, iters = args.seq, args.iters
    machines, strategies = (H200_MACHINES, GPU_STRATEGIES) if gpu else (CPU_MACHINES, None)
  implementation = "cudnn" if gpu else None
  cases = []
  out = {"device": jax.devices()[0].device_kind, "n_devices": n, "jax_version": jax.__version__,
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
         "command": "python -m benchmarks.llama_block " + " ".join(sys.argv[1:] if argv is None else argv),
         "config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
         "machines": {k: m.to_dict() for k, m in machines.items()}, "iters": iters, "cases": cases}

  def saved():  # rewritten after every result, so that a run cut short keeps what it measured
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)

  measure_iters = args.measure_iters or 0
  out["measure_iters"] = measure_iters
  out["machines_source"] = args.machines or ("calibrated" if gpu and not args.smoke else "reference")
  for s in seqs:
    cases.append({})
    if out["machines_source"] == "calibrated":
      machines = calibrated_machines(config, s, mesh, "cudnn_attention" if gpu else "xla")
      cases[-1]["machines"] = {k: m.to_dict() for k, m in machines.items()}
      print(f"seq {s}: calibrated", *machines.values(), sep="\n", flush=True)
    run_case(config, s, mesh, machines, strategies, iters, args.baselines, implementation,
             split=not args.no_split, case=cases[-1], saved=saved, measure_iters=measure_iters)
  print(json.dumps([{"seq": c["seq"], **c["summary"]} for c in cases], indent=1))
  if args.smoke:
    bad = [r for c in cases for r in c["contestants"]
           if "error" in r or r["out_rel_err"] > 5e-2 or r["grad_rel_err"] > 5e-2]
    bad += [r for c in cases for r in c["operator_split"] if any(k.endswith("_error") for k in r)]
    if bad:
      raise SystemExit(f"smoke run failed: {bad}")


if __name__ == "__main__":
  main()
