"""The ``models/`` Llama decorated by ``jm.distribute`` against the same model undecorated: one training step.

Per case (a ``models.CONFIGS`` config cut to ``--layers`` layers, ``--seqs`` tokens, batch 1), two contestants
on the same parameters and tokens: ``plain`` (the model as written, its attention through
``jax.nn.dot_product_attention`` with cuDNN on GPUs and XLA on CPUs) and ``jaxmercury`` (the same model, its
attention written with the XLA implementation, which the rewrite recognizes (a cuDNN call traces to cuDNN's own
call), after ``jm.distribute(..., tune=True, training=True)``: every attention and linear layer tuned for a
training step, the plain program among each tune's candidates, the database at ``--db``). The step is the loss
and the gradients of every parameter (``nnx.value_and_grad`` of ``models.train.loss_fn``), jitted; the
optimizer's update is the same elementwise work in both and is left out. The record keeps the tuning's wall
time (calibration included on a fresh database) and what each operator chose.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

import jaxmercury as jm
from benchmarks import harness
from benchmarks.cases import parse_size, size_label
from jaxmercury.tuner import measure
from models import CONFIGS
from models.llama import Llama
from models.train import loss_fn, random_tokens


@dataclasses.dataclass(frozen=True)
class ModelCase:
  config: str
  layers: int
  tokens: int
  mesh: str = ""
  op: str = "model"

  @property
  def name(self) -> str:
    return f"llama {self.config} L{self.layers} T{size_label(self.tokens)} training step"

  @property
  def flops(self) -> float:
    c = CONFIGS[self.config]
    per_token = 2 * self.layers * (c.dim * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.dim
                                   + 3 * c.dim * c.hidden) + 2 * c.dim * c.vocab
    return 3.0 * self.tokens * per_token  # forward and backward; attention's quadratic part left out


def plan(args) -> list:
  config = "tiny" if args.smoke else args.config
  tokens = args.seqs or ((64,) if args.smoke else (parse_size("4K"),))
  return [ModelCase(config, 2, t, args.mesh or ("8" if args.smoke else "1")) for t in tokens]


class Env:
  def __init__(self, args, results: dict, deadline: float):
    self.args, self.results, self.deadline = args, results, deadline
    self.database = jm.Database(args.db)


def attend(implementation):
  def fn(query, key, value, **kwargs):
    return jax.nn.dot_product_attention(query, key, value, is_causal=kwargs.get("is_causal", False),
                                        implementation=implementation)
  return fn


def build(case, implementation: str):
  """The case's Llama in bf16, its attention through ``jax.nn.dot_product_attention`` with ``implementation``."""
  config = dataclasses.replace(CONFIGS[case.config], layers=case.layers).with_dtype(jnp.bfloat16)
  model = Llama(config, rngs=nnx.Rngs(0))
  for _, module in nnx.iter_graph(model):
    if isinstance(module, nnx.Module) and hasattr(module, "attention_fn"):
      module.attention_fn = attend(implementation)
  return model


def step_of(model, tokens):
  """``(step, (state, tokens))``: the jitted step takes the parameters as an argument, not as constants."""
  graph, state = nnx.split(model)

  @jax.jit
  def step(state, tokens):
    return nnx.value_and_grad(loss_fn)(nnx.merge(graph, state), tokens)
  return step, (state, tokens)


def run_case(env, case) -> dict:
  args = env.args
  mesh = harness.make_mesh(case.mesh)
  implementation = "xla" if args.smoke else "cudnn"
  tokens = random_tokens(jax.random.key(args.seed or 0), 1, case.tokens, CONFIGS[case.config].vocab)
  rec = {"name": case.name, "op": case.op, "config": dataclasses.asdict(case), "mesh": dict(mesh.shape),
         "training": True, "attention": implementation}
  tuning = {}

  def decorated():
    lines = []
    t0 = time.perf_counter()
    # jm.distribute recognizes attention in the traced program: jax.nn's XLA computation, not cuDNN's custom
    # call; the routed schedules run cuDNN's blocks on GPUs themselves
    model = jm.distribute(build(case, "xla"), mesh=mesh, database=env.database, tune=True,
                          training=True, top_k=args.top_k, space=args.space, iters=args.tune_iters,
                          log=lambda s: (lines.append(s), harness.log("    " + s)))
    step, step_args = step_of(model, tokens)
    step.lower(*step_args)  # tunes every operator while tracing
    tuning.update(wall_s=round(time.perf_counter() - t0, 2),
                  operators=[line for line in lines if line.startswith("== ")])
    return step, step_args

  contestants = [harness.Contestant("plain", "baseline", lambda: step_of(build(case, implementation), tokens),
                                    f"the model as written, attention {implementation}"),
                 harness.Contestant("jaxmercury", "jaxmercury", decorated,
                                    "jm.distribute(tune=True, training=True)")]
  settings = harness.Settings.from_args(args, env.deadline, measure.gradient_tolerance("bfloat16"))
  records, ref = harness.run_contestants(contestants, [tokens], settings)
  rec["tuning"] = tuning
  jax.clear_caches()
  return harness.finish(rec, records, ref, flops_per_device=case.flops / mesh.devices.size)
