"""The ``models/`` Llama decorated by ``jm.distribute`` against the same model in plain JAX: one training step.

Per case (a ``models.CONFIGS`` config cut to ``--model_layers`` layers, ``--seqs`` tokens, batch 1) the contestants
run on the same parameters and tokens. The step is the loss and the gradients of every parameter
(``nnx.value_and_grad`` of ``models.train.loss_fn``), jitted; the optimizer's update is the same elementwise work
in all and is left out. The record keeps the tuning's wall time (from the decoration to the compiled step,
calibration included on a fresh database) and what each operator chose (the tuner's ``== operator i of n`` lines
and each call's route).

Without ``--fsdp``, on ``--mesh`` (default one device): ``plain`` (the model as written, its attention through
``jax.nn.dot_product_attention`` with cuDNN on GPUs and XLA on CPUs) and ``jaxmercury`` (the same model, its
attention written with the XLA implementation, which the rewrite recognizes (a cuDNN call traces to cuDNN's own
call), after ``jm.distribute(..., tune=True, training=True)``: every attention and linear layer tuned for a
training step, the plain program among each tune's candidates, the database at ``--db``).

With ``--fsdp``, on JAX's default mesh (``jax.make_mesh`` over ``--mesh``, default every device, Explicit axes,
under ``jax.set_mesh``): the model sharded as a user shards it (``models.llama.Sharding``: weights stored split
over the mesh and gathered before each matmul, activations split along the sequence), against

* ``plain_ulysses`` and ``plain_allgather_kv``: the same model with its attention as a user writes it in plain
  JAX (``benchmarks.baselines.attention``): DeepSpeed-Ulysses (all-to-all to heads, cuDNN, all-to-all back), and
  all-gathered K/V with the local queries (cuDNN per key chunk, merged by log-sum-exp: the causal mask at the
  queries' offset); XLA partitions the rest. Ratios are against the faster.
* ``jaxmercury``: the model as sharded, its attention written out (``Sharding.attend``: the XLA computation with
  each product's ``out_sharding``), under ``jm.distribute(..., tune=True, training=True)``.
* ``graph``: ``jm.graph``'s plan of one decoder block (``models.block_graph``, the residual split along the
  sequence, searched for a training step), run for every block of the model, on a mesh of Auto axes over the same
  devices: the plan chooses its own weight layouts (not FSDP); the embedding, final norm, output layer and loss are
  the model's own, partitioned by XLA. The graph search plans one block, not a whole model; the record says so.

Each timed contestant records tokens per second per device and, where the device's peak is known
(``PEAK_BF16_DENSE``), its MFU: the step's matrix flops per device over its time and that peak. The mark: the
``jaxmercury`` step at least ``MARK`` of the best plain-JAX step's speed.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from benchmarks import harness
from benchmarks import llama as block_suite
from benchmarks.baselines import attention as baselines
from benchmarks.cases import parse_size, size_label
from jaxmercury import graph as jg
from jaxmercury.tuner import measure
from models import CONFIGS
from models import block_graph as bg
from models.llama import Llama, Sharding
from models.train import loss_fn, random_tokens

# The tunes of a step may take this share of the run's time left (at least the minimum): the rest is the
# contestants' compiles and timing.
TUNE_BUDGET_SHARE, TUNE_BUDGET_MIN_S = 0.5, 60.0
MARK = 1.05  # --fsdp: jaxmercury's step over the best plain-JAX step's time, at least
# Dense bf16 peak per device (NVIDIA's datasheets, SXM parts), by a name in ``device_kind``.
PEAK_BF16_DENSE = {"H100": 989.4e12, "H200": 989.4e12}


@dataclasses.dataclass(frozen=True)
class ModelCase:
  config: str
  layers: int
  tokens: int
  mesh: str = ""
  fsdp: bool = False
  op: str = "model"

  @property
  def name(self) -> str:
    sharded = f" FSDP+SP mesh {self.mesh or 'all'}" if self.fsdp else ""
    return f"llama {self.config} L{self.layers} T{size_label(self.tokens)} training step{sharded}"

  @property
  def flops(self) -> float:
    """A training step's matrix flops, 3x the forward's: the GEMMs, the output layer and causal attention's
    visible half (both products)."""
    c = CONFIGS[self.config]
    per_token = 2 * self.layers * (c.dim * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.dim
                                   + 3 * c.dim * c.hidden) + 2 * c.dim * c.vocab
    attention = 2 * self.layers * self.tokens ** 2 * c.heads * c.head_dim
    return 3.0 * (self.tokens * per_token + attention)


def plan(args) -> list:
  config = "tiny" if args.smoke else args.config
  layers = args.model_layers or 2
  tokens = args.seqs or ((64,) if args.smoke else (parse_size("4K"),))
  # --fsdp smoke: 4 devices, whose ranks split the tiny config's heads (Ulysses)
  mesh = args.mesh or (("4" if args.fsdp else "8") if args.smoke else ("" if args.fsdp else "1"))
  return [ModelCase(config, layers, t, mesh, args.fsdp) for t in tokens]


class Env:
  def __init__(self, args, results: dict, deadline: float):
    self.args, self.results, self.deadline = args, results, deadline
    self.database = jm.Database(args.db)


def attend(implementation):
  def fn(query, key, value, **kwargs):
    return jax.nn.dot_product_attention(query, key, value, is_causal=kwargs.get("is_causal", False),
                                        implementation=implementation)
  return fn


def build(case, implementation: str | None, sharding: Sharding | None = None):
  """The case's Llama in bf16 (with ``sharding``: so sharded, built under its mesh), its attention through
  ``jax.nn.dot_product_attention`` with ``implementation`` (None: the model's own attention)."""
  config = dataclasses.replace(CONFIGS[case.config], layers=case.layers, sharding=sharding).with_dtype(jnp.bfloat16)
  model = Llama(config, rngs=nnx.Rngs(0))
  if implementation is not None:
    with_attention(model, attend(implementation))
  return model


def with_attention(model, fn):
  """``model`` with every attention computed by ``fn`` (``attention_fn``'s signature)."""
  for _, module in nnx.iter_graph(model):
    if isinstance(module, nnx.Module) and hasattr(module, "attention_fn"):
      module.attention_fn = fn
  return model


def step_of(model, tokens, loss=loss_fn):
  """``(step, (state, tokens))``: the jitted step takes the parameters as an argument, not as constants."""
  graph, state = nnx.split(model)

  @jax.jit
  def step(state, tokens):
    return nnx.value_and_grad(loss)(nnx.merge(graph, state), tokens)
  return step, (state, tokens)


def decorated(env, case, model, mesh, tokens, tuning: dict):
  """A builder of ``model()`` under ``jm.distribute(tune=True, training=True)``'s step: tunes every operator while
  tracing it within ``TUNE_BUDGET_SHARE`` of the time the run has left (what it leaves out runs plain, and the
  log says so), keeping in ``tuning`` the wall time, the tune's ``== `` lines and each call's route (``jm.explain``:
  module, schedule and where it came from, also for operators the database held already)."""
  args = env.args

  def build_step():
    lines = []
    t0 = time.perf_counter()
    budget = round(max(TUNE_BUDGET_MIN_S, TUNE_BUDGET_SHARE * (env.deadline - time.time())))
    routed = jm.distribute(model(), mesh=mesh, database=env.database, tune=True, training=True, top_k=args.top_k,
                           space=args.space, iters=args.tune_iters, time_budget_s=budget,
                           log=lambda s: (lines.append(s), harness.log("    " + s)))
    step, step_args = step_of(routed, tokens)
    compiled = step.lower(*step_args).compile()  # tunes every operator while tracing
    tuning.update(wall_s=round(time.perf_counter() - t0, 2), budget_s=budget,
                  operators=[line for line in lines if line.startswith("== ")],
                  routes=[f"{e.module or '-'} {e.kind}: {e.schedule or '-'} ({e.reason})"
                          for e in jm.explain(routed, tokens[:, :-1])])
    return compiled, step_args
  return build_step


def run_case(env, case) -> dict:
  if case.fsdp:
    return run_sharded(env, case)
  args = env.args
  mesh = harness.make_mesh(case.mesh)
  implementation = "xla" if args.smoke else "cudnn"
  tokens = random_tokens(jax.random.key(args.seed or 0), 1, case.tokens, CONFIGS[case.config].vocab)
  rec = {"name": case.name, "op": case.op, "config": dataclasses.asdict(case), "mesh": dict(mesh.shape),
         "training": True, "attention": implementation}
  tuning = {}
  # jm.distribute recognizes attention in the traced program: jax.nn's XLA computation, not cuDNN's custom call;
  # the routed schedules run cuDNN's blocks on GPUs themselves
  contestants = [harness.Contestant("plain", "baseline", lambda: step_of(build(case, implementation), tokens),
                                    f"the model as written, attention {implementation}"),
                 harness.Contestant("jaxmercury", "jaxmercury",
                                    decorated(env, case, lambda: build(case, "xla"), mesh, tokens, tuning),
                                    "jm.distribute(tune=True, training=True)")]
  settings = harness.Settings.from_args(args, env.deadline, measure.gradient_tolerance("bfloat16"))
  records, ref = harness.run_contestants(contestants, [tokens], settings)
  rec["tuning"] = tuning
  jax.clear_caches()
  return harness.finish(rec, records, ref, flops_per_device=case.flops / mesh.devices.size)


# ------------------------------------------------------------------ --fsdp: FSDP and sequence split, Explicit axes


def run_sharded(env, case) -> dict:
  """The FSDP, sequence-split model's step: the plain-JAX attentions, jaxmercury and the graph plan (module doc)."""
  args = env.args
  mesh = harness.make_mesh(case.mesh, AxisType.Explicit)
  levels, c = tuple(mesh.axis_names), CONFIGS[case.config]
  sharding = Sharding(levels[0] if len(levels) == 1 else levels)
  implementation = "xla" if args.smoke else "cudnn"
  n = mesh.devices.size
  rec = {"name": case.name, "op": case.op, "config": dataclasses.asdict(case), "mesh": dict(mesh.shape),
         "training": True, "attention": implementation,
         "sharding": f"weights split over {levels} along their first dimension and gathered before use (FSDP); "
                     f"activations split along the sequence over {levels}; Explicit axes under jax.set_mesh"}
  tuning, graph_info = {}, {}
  with jax.set_mesh(mesh):
    tokens = random_tokens(jax.random.key(args.seed or 0), 1, case.tokens, c.vocab)
  plain = lambda fn: under(mesh, lambda: step_of(with_attention(build(case, None, sharding), fn), tokens))
  ulysses_why = baselines.heads_problem(c.heads, c.kv_heads, n)
  contestants = [
      harness.Contestant("plain_ulysses", "baseline", None if ulysses_why else plain(
          causal_attention(baselines.ulysses(mesh, levels, causal=True, impl=implementation, heads=c.heads,
                                             kv_heads=c.kv_heads))),
          f"plain JAX: DeepSpeed-Ulysses (all-to-all to heads, {implementation}, all-to-all back)",
          skip=ulysses_why and f"ulysses: {ulysses_why}"),
      harness.Contestant("plain_allgather_kv", "baseline", plain(
          causal_attention(baselines.context_parallel(mesh, levels, causal=True, impl=implementation))),
          f"plain JAX: all-gathered K/V, the local queries at their offset ({implementation} per key chunk)"),
      harness.Contestant("jaxmercury", "jaxmercury",
                         under(mesh, decorated(env, case, lambda: build(case, None, sharding), mesh, tokens, tuning)),
                         "jm.distribute(tune=True, training=True) of the model as sharded, attention written out"),
      harness.Contestant("graph", "jaxmercury", lambda: graph_step(env, case, mesh, tokens, graph_info),
                         "jm.graph's plan of one decoder block, run for every block (its own weight layouts)")]
  settings = harness.Settings.from_args(args, env.deadline, measure.gradient_tolerance("bfloat16"))
  records, ref = harness.run_contestants(contestants, [tokens], settings)
  rec.update(tuning=tuning, graph=graph_info)
  jax.clear_caches()
  harness.finish(rec, records, ref, flops_per_device=case.flops / n)
  rates(records, case, n, jax.devices()[0].device_kind)
  mine = next(r for r in records if r["name"] == "jaxmercury")
  if "ratio_to_best_baseline" in mine:
    rec["marks"] = [harness.mark("jaxmercury over the best plain-JAX model", mine["ratio_to_best_baseline"],
                                 at_least=MARK)]
  return rec


def under(mesh, build):
  """A builder of ``build()``'s step compiled under ``jax.set_mesh(mesh)`` (the harness runs it outside)."""
  def compiled():
    with jax.set_mesh(mesh):
      step, step_args = build()
      return (step.lower(*step_args).compile() if hasattr(step, "lower") else step), step_args
  return compiled


def causal_attention(fn):
  """``fn(q, k, v)`` (a causal baseline) as an ``attention_fn``."""
  def attention_fn(query, key, value, *, is_causal: bool = False):
    if not is_causal:
      raise ValueError("the baselines here are built causal; the model called a non-causal attention")
    return fn(query, key, value)
  return attention_fn


def rates(records: list[dict], case: ModelCase, devices: int, device_kind: str):
  """Each timed record's tokens per second per device and, where the device's peak is known, its MFU."""
  peak = next((v for k, v in PEAK_BF16_DENSE.items() if k in device_kind), None)
  for r in records:
    if "median_ms" not in r:
      continue
    r["tokens_per_s_per_device"] = case.tokens / (r["median_ms"] * 1e-3) / devices
    if peak:
      r["mfu"] = r["tflops_per_device"] * 1e12 / peak


def graph_step(env, case, explicit_mesh, tokens, info: dict):
  """The model's step with every decoder block run by ``jm.graph``'s plan of one block (module doc); ``info``:
  what the plan covers and chose."""
  mesh = jax.make_mesh(explicit_mesh.axis_sizes, explicit_mesh.axis_names,
                       axis_types=(AxisType.Auto,) * len(explicit_mesh.axis_names),
                       devices=explicit_mesh.devices.flatten())
  config = dataclasses.replace(CONFIGS[case.config], layers=case.layers).with_dtype(jnp.bfloat16)
  with jax.set_mesh(mesh):  # the graph's constants (rotary positions) are made on this mesh, not the caller's
    return _graph_step(env, case, mesh, config, tokens, info)


def _graph_step(env, case, mesh, config, tokens, info: dict):
  gpu = jax.devices()[0].platform == "gpu"
  suite_env = type("BlockEnv", (), dict(mesh=mesh, gpu=gpu, calibrated=gpu and not env.args.smoke))()
  t0 = time.perf_counter()
  machines = block_suite.machines_of(suite_env, config, case.tokens)
  graph = bg.block_graph(config, batch=1, seq=case.tokens, mesh=mesh, machines=machines,
                         strategies=block_suite.GPU_STRATEGIES if gpu else None)
  found = jg.search(graph, machines, training=True)
  block, specs = bg.planned_block(found)
  info.update(covers="each decoder block: jm.graph's plan of one block for a training step, the residual split "
                     "along the sequence, weights in the plan's layouts (not FSDP); the embedding, final norm, "
                     "output layer and loss as the model writes them, partitioned by XLA",
              plan=str(found), choice={k: v.name for k, v in found.choice.items()},
              predicted_ms=found.seconds * 1e3, search_s=round(time.perf_counter() - t0, 2))
  harness.log(f"  graph plan:\n{found}")

  def loss(model, tokens):
    x = model.embed(tokens[:, :-1])
    for layer in model.blocks:
      x = block(bg.block_params(layer), x)
    logits = model.lm_head(model.norm(x))
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()

  model = Llama(config, rngs=nnx.Rngs(0))
  for layer in model.blocks:
    for key, param in bg.block_variables(layer).items():
      param.set_value(jax.device_put(param[...], NamedSharding(mesh, specs.get(key, P()))))
  nnx.update(model, jax.device_put(nnx.state(model, nnx.Not(nnx.PathContains("blocks"))), NamedSharding(mesh, P())))
  step, (state, _) = step_of(model, tokens, loss)
  step_args = (state, jax.device_put(tokens, NamedSharding(mesh, P())))
  return step.lower(*step_args).compile(), step_args  # compiled here: the caller's mesh is the Explicit one
