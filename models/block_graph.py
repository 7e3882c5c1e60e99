"""One Llama decoder block as a ``jaxmercury.graph`` DAG, and its plan run on the block's parameters.

Nodes, on activations flattened to ``[tokens, features]``::

  x -> attention_norm -> wq -> rope_q --\\
                      -> wk -> rope_k ---> attention -> wo -> attention_residual (+ x)
                      -> wv ------------/
  attention_residual -> mlp_norm -> w_gate --\\
                                 -> w_up -----> swiglu -> w_down -> mlp_residual (+ attention_residual) -> y

The GEMMs and the attention are jaxmercury programs with library candidates;
the rest are glue nodes that run in any layout that keeps what they reduce
over whole (the features for the norms, the head dimension for the rotary
embedding).

Beside the searched plan, ``whole_blocks`` gives the block as a user writes it
in plain JAX for XLA to partition (Megatron tensor parallelism, and its
sequence-parallel variant); ``jaxmercury.graph.choose`` times them side by
side and never picks a plan measured slower (``chosen_block`` runs the
choice).

With ``batch > 1`` a sequence-split ``[batch, seq, heads, head_dim]`` layout
has no counterpart among ``[tokens, features]`` layouts (tokens are
batch-major), so edges needing one are refused; plan batch-1 blocks, or
split the batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.graph import Graph, Layout, WholeProgram, compile_plan, glue_node, input_node, op_node, output_node
from jaxmercury.graph.options import unsplit
from models.llama import LlamaConfig, rms_norm, rotary, swiglu

PARAMS = ("attention_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")  # Megatron splits their outputs' features
ROW = ("wo", "w_down")  # and these GEMMs' reduction


def sequence_parallel(mesh) -> Layout:
  """Tokens split over every mesh level, features whole: the residual stream's usual layout."""
  return Layout((tuple(mesh.axis_names), ()))


def block_graph(config: LlamaConfig, *, batch: int, seq: int, mesh, machines, residual: Layout | None = None,
                database=None, strategies=None) -> Graph:
  """The block's DAG with every node's candidates.

  Args:
    config: the model's sizes and dtype.
    batch: sequences per batch.
    seq: tokens per sequence.
    mesh: the device mesh.
    machines: a ``Machine`` or a mapping by program pattern, for candidate times.
    residual: the layout of the block's input and output ``[tokens, dim]``;
      default ``sequence_parallel(mesh)``.
    database: a ``jaxmercury.Database`` whose measured times replace predictions.
    strategies: library strategy names to consider (default all but ``ring_zigzag``).
  """
  c = config
  tokens, dt = batch * seq, c.dtype
  residual = residual or sequence_parallel(mesh)
  g = Graph(mesh)
  common = dict(mesh=mesh, machines=machines)
  ops = dict(database=database, strategies=strategies, **common)

  def gemm(name, source, n, k):
    return op_node(name, jm.programs.matmul(tokens, n, k, dtype=dt), inputs={"A": source}, params={"B": name},
                   **ops)

  g.add(input_node("x", (tokens, c.dim), dt, residual))
  g.add(glue_node("attention_norm", lambda x, w: rms_norm(x, w, c.norm_eps), ["x"], (tokens, c.dim), dt,
                  params=["attention_norm"], allowed=unsplit(1), **common))
  g.add(gemm("wq", "attention_norm", c.heads * c.head_dim, c.dim))
  g.add(gemm("wk", "attention_norm", c.kv_heads * c.head_dim, c.dim))
  g.add(gemm("wv", "attention_norm", c.kv_heads * c.head_dim, c.dim))
  positions = jnp.arange(seq)
  for name, source, heads in (("rope_q", "wq", c.heads), ("rope_k", "wk", c.kv_heads)):
    g.add(glue_node(name, lambda x: rotary(x, positions, c.rope_theta), [source], (batch, seq, heads, c.head_dim),
                    dt, allowed=unsplit(3), **common))
  attention = jm.programs.attention(batch, c.heads, c.kv_heads, seq, seq, c.head_dim, causal=True, dtype=dt)
  node = op_node("attention", attention, inputs={"q": "rope_q", "k": "rope_k", "v": "wv"}, params={}, **ops)
  g.add(node)
  g.add(gemm("wo", "attention", c.dim, c.heads * c.head_dim))
  g.add(glue_node("attention_residual", jnp.add, ["x", "wo"], (tokens, c.dim), dt, **common))
  g.add(glue_node("mlp_norm", lambda x, w: rms_norm(x, w, c.norm_eps), ["attention_residual"], (tokens, c.dim), dt,
                  params=["mlp_norm"], allowed=unsplit(1), **common))
  g.add(gemm("w_gate", "mlp_norm", c.hidden, c.dim))
  g.add(gemm("w_up", "mlp_norm", c.hidden, c.dim))
  g.add(glue_node("swiglu", swiglu, ["w_gate", "w_up"], (tokens, c.hidden), dt, **common))
  g.add(gemm("w_down", "swiglu", c.dim, c.hidden))
  g.add(glue_node("mlp_residual", jnp.add, ["attention_residual", "w_down"], (tokens, c.dim), dt, **common))
  g.add(output_node("y", "mlp_residual", (tokens, c.dim), dt, residual))
  return g


def block_variables(block) -> dict:
  """The parameter variables of a ``models.llama.DecoderBlock`` by graph parameter key (``PARAMS``)."""
  a, m = block.attention, block.mlp
  return {"attention_norm": block.attention_norm.weight, "wq": a.wq.kernel, "wk": a.wk.kernel, "wv": a.wv.kernel,
          "wo": a.wo.kernel, "mlp_norm": block.mlp_norm.weight, "w_gate": m.w_gate.kernel, "w_up": m.w_up.kernel,
          "w_down": m.w_down.kernel}


def block_params(block) -> dict:
  """The parameters of a ``models.llama.DecoderBlock`` by graph parameter key."""
  return {key: variable[...] for key, variable in block_variables(block).items()}


def planned_block(plan):
  """``f(params, x [batch, seq, dim]) -> y`` running ``plan``, and the layouts its parameters are read in.

  Returns:
    ``(f, param_specs)``: ``param_specs`` maps parameter keys to ``PartitionSpec``
    (keys absent are read replicated).
  """
  compiled = compile_plan(plan)

  def f(params, x):
    b, s, d = x.shape
    return compiled({"x": jnp.reshape(x, (b * s, d))}, params)["y"].reshape(b, s, d)

  return f, dict(compiled.param_specs)


def block_apply(params: dict, x, config: LlamaConfig, *, implementation: str | None = None,
                attention_sharding=None):
  """The block as one plain function of its parameters (what XLA partitions by itself in baselines).

  ``attention_sharding``: a sharding that q, k and v are constrained to before
  attention (cuDNN's partitioner takes batch or head splits only, never a
  sequence split), or None to leave them to XLA.
  """
  c = config
  b, s, _ = x.shape
  positions = jnp.arange(s)
  h = rms_norm(x, params["attention_norm"], c.norm_eps)
  q = rotary((h @ params["wq"]).reshape(b, s, c.heads, c.head_dim), positions, c.rope_theta)
  k = rotary((h @ params["wk"]).reshape(b, s, c.kv_heads, c.head_dim), positions, c.rope_theta)
  v = (h @ params["wv"]).reshape(b, s, c.kv_heads, c.head_dim)
  if attention_sharding is not None:
    q, k, v = (jax.lax.with_sharding_constraint(t, attention_sharding) for t in (q, k, v))
  o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  x = x + o.reshape(b, s, c.heads * c.head_dim) @ params["wo"]
  h = rms_norm(x, params["mlp_norm"], c.norm_eps)
  return x + swiglu(h @ params["w_gate"], h @ params["w_up"]) @ params["w_down"]


def whole_blocks(config: LlamaConfig, mesh, *, batch: int, seq: int, residual: Layout | None = None,
                 implementation: str | None = None) -> list[WholeProgram]:
  """The block as a user would write it (``block_apply``) for XLA to partition, as the graph's whole programs.

  Both read ``x [tokens, dim]`` in the graph's ``residual`` layout and return
  ``y`` in it; their weights are split as Megatron splits them over every
  mesh level (``COLUMN`` by output features, ``ROW`` by the reduction), and
  attention is constrained to a head split where the heads divide the mesh.

  - ``xla_megatron_tp``: the residual stream whole on every device inside the block;
  - ``xla_megatron_tp_sp``: the residual stream split by tokens (sequence parallelism), XLA gathering it
    before the column GEMMs and reduce-scattering after the row GEMMs.

  Args:
    config: the model's sizes and dtype.
    batch: sequences per batch.
    seq: tokens per sequence.
    mesh: the device mesh.
    residual: the layout of the block's input and output; default ``sequence_parallel(mesh)``.
    implementation: ``jax.nn.dot_product_attention``'s (None: JAX's choice).
  """
  c = config
  residual = residual or sequence_parallel(mesh)
  levels = tuple(mesh.axis_names)
  split = levels[0] if len(levels) == 1 else levels
  devices = math.prod(mesh.shape.values())
  specs = {**{k: P(None, split) for k in COLUMN}, **{k: P(split, None) for k in ROW}}
  heads = NamedSharding(mesh, P(None, None, split, None)) if c.heads % devices == c.kv_heads % devices == 0 else None

  def block(inside):
    def fn(inputs, params):
      x = jax.lax.with_sharding_constraint(inputs["x"], NamedSharding(mesh, inside))
      y = block_apply(params, x.reshape(batch, seq, c.dim), c, implementation=implementation,
                      attention_sharding=heads)
      return {"y": jax.lax.with_sharding_constraint(y.reshape(batch * seq, c.dim), NamedSharding(mesh, residual.spec))}
    return fn

  given = {"x": residual.spec}
  return [WholeProgram("xla_megatron_tp", block(P()), specs, given),
          WholeProgram("xla_megatron_tp_sp", block(sequence_parallel(mesh).spec), specs, given)]


def chosen_block(choice):
  """``f(params, x [batch, seq, dim]) -> y`` running what ``jaxmercury.graph.choose`` chose (a plan or a whole
  program), and the layouts its parameters are read in."""
  run = choice.chosen.fn

  def f(params, x):
    b, s, d = x.shape
    return run({"x": jnp.reshape(x, (b * s, d))}, params)["y"].reshape(b, s, d)

  return f, dict(choice.chosen.param_specs)
