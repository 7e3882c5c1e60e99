"""Mixture of experts (issue 31): the program, its schedules and their gradients against a dense reference."""

import contextlib
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, h100_mesh, make_mesh, rel_err, store_library_winners
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.analysis.memory import memory_per_device


def dense_moe(x, router, w_gate, w_up, w_down, *, top_k, capacity_factor=None):
  """Every expert on every token, masked by the selection and the capacity rule (written independently)."""
  tokens, experts = x.shape[0], router.shape[1]
  logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
  values, picked = jax.lax.top_k(logits, top_k)
  gates = jax.nn.softmax(values, axis=-1)
  mask = jax.nn.one_hot(picked, experts)  # [t, k, e]
  if capacity_factor is not None:
    capacity = math.ceil(capacity_factor * tokens * top_k / experts)
    per_token = mask.sum(axis=1)
    earlier = jnp.cumsum(per_token, axis=0) - per_token  # assignments of lower tokens to each expert
    mask = mask * (earlier < capacity)[:, None, :]
  weights = jnp.einsum("tk,tke->te", gates, mask)
  a = jnp.einsum("td,edf->etf", x, w_gate, preferred_element_type=jnp.float32)
  b = jnp.einsum("td,edf->etf", x, w_up, preferred_element_type=jnp.float32)
  h = (jax.nn.silu(a) * b).astype(x.dtype)
  out = jnp.einsum("etf,efd->etd", h, w_down, preferred_element_type=jnp.float32)
  return jnp.einsum("te,etd->td", weights, out).astype(x.dtype)


def dropped(x, router, *, top_k, capacity_factor):
  """How many (token, expert) assignments the capacity drops."""
  tokens, experts = x.shape[0], router.shape[1]
  _, picked = jax.lax.top_k(jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32)), top_k)
  counts = np.bincount(np.asarray(picked).ravel(), minlength=experts)
  return int(np.maximum(counts - math.ceil(capacity_factor * tokens * top_k / experts), 0).sum())


def inputs(prog, *, biased: bool):
  """Fresh inputs; ``biased``: every token shares a direction the router's expert 0 column follows, so most
  tokens pick expert 0."""
  x, router, *weights = prog.random_inputs(fresh_key())
  if biased:
    u = jax.random.normal(fresh_key(), (x.shape[1],))
    u = u / jnp.linalg.norm(u)
    x = x + 3.0 * u
    router = router.at[:, 0].set(8.0 * u + 0.1 * router[:, 0])
  return (x, router, *weights)


@pytest.mark.parametrize("experts,top_k,cf,biased", [(8, 2, None, False), (16, 1, 0.5, False), (8, 1, 1.0, True),
                                                    (16, 2, None, True)])
def test_reference_equals_dense(experts, top_k, cf, biased):
  prog = jm.programs.moe(48, 16, 24, experts, top_k, capacity_factor=cf)
  xs = inputs(prog, biased=biased)
  want = jax.jit(lambda *a: dense_moe(*a, top_k=top_k, capacity_factor=cf))(*xs)
  assert rel_err(jax.jit(prog.reference)(*xs), want) < 1e-6
  if biased:
    _, picked = jax.lax.top_k(jnp.dot(xs[0], xs[1]), top_k)
    assert np.mean(np.asarray(picked[:, 0]) == 0) > 0.7  # most tokens pick expert 0


def test_bad_input_names_the_problem():
  for args, word in (((64, 16, 32, 8, 9), "top_k"), ((64, 16, 32, 8, 0), "top_k"), ((0, 16, 32, 8, 1), "tokens")):
    with pytest.raises(jm.ScheduleError, match=word):
      jm.programs.moe(*args)
  with pytest.raises(jm.ScheduleError, match="capacity_factor"):
    jm.programs.moe(64, 16, 32, 8, 2, capacity_factor=0.0)
  mesh = make_mesh("8")
  prog = jm.programs.moe(64, 16, 32, 6, 2)  # 6 experts do not divide over 8 devices
  assert "expert_parallel" not in jm.library(prog, mesh)
  s = jm.Schedule(prog, mesh).pad("e", 8).tile("e", 8).parallelize("e0", "x")
  with pytest.raises(jm.ScheduleError, match="6 experts do not divide over mesh level 'x'"):
    s.dispatch("e0")
  prog = jm.programs.moe(64, 16, 32, 8, 2)
  s = jm.Schedule(prog, mesh).tile("t", 8).parallelize("t0", "x")
  with pytest.raises(jm.PreconditionError, match="not the experts axis"):
    s.dispatch("t0")
  with pytest.raises(jm.PreconditionError, match="not a routed program"):
    jm.Schedule(jm.programs.matmul(64, 64, 64), mesh).tile("n", 8).parallelize("n0", "x").dispatch("n0")
  capped = jm.programs.moe(64, 16, 32, 8, 2, capacity_factor=1.0)
  with pytest.raises(jm.ScheduleError, match="capacity"):  # the dense body counts the capacity per block
    jm.Schedule(capped, mesh).tile("t", 8).parallelize("t0", "x").compile()


def forward_and_gradients(f, xs, cot):
  """``(f(*xs), the gradients of sum(f * cot) by every input)``, in one compiled program."""
  def both(*a):
    out, pullback = jax.vjp(f, *a)
    return out, pullback(cot.astype(out.dtype))
  return jax.jit(both)(*xs)


# (mesh, axis types, inside jax.set_mesh, experts, top_k, capacity factor, biased router)
CASES = [("8", AxisType.Explicit, False, 8, 2, None, False), ("8", AxisType.Auto, True, 16, 1, 0.5, False),
         ("8", AxisType.Explicit, True, 16, 2, 1.0, True), ("8", AxisType.Auto, False, 8, 1, None, True),
         ("2x4", AxisType.Auto, False, 8, 2, 0.5, True), ("2x4", AxisType.Explicit, True, 16, 2, None, False),
         ("2x4", AxisType.Explicit, False, 8, 1, 1.0, False), ("2x4", AxisType.Auto, True, 16, 1, None, True)]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1].name}-{'in' if c[2] else 'out'}-e{c[3]}k{c[4]}"
                                             f"-cf{c[5]}{'-biased' if c[6] else ''}" for c in CASES])
def test_schedules_forward_and_gradients(case):
  """The moe schedules of the library (one per case, in turn) equal the dense reference, forward and the
  gradients of all five inputs."""
  mesh_name, kind, inside, experts, top_k, cf, biased = case
  mesh = make_mesh(mesh_name, kind)
  prog = jm.programs.moe(64, 16, 24, experts, top_k, capacity_factor=cf)
  xs = inputs(prog, biased=biased)
  if cf is not None and cf < 1.0:
    assert dropped(xs[0], xs[1], top_k=top_k, capacity_factor=cf) > 0
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  want, want_grads = forward_and_gradients(lambda *a: dense_moe(*a, top_k=top_k, capacity_factor=cf), xs, cot)
  lib = jm.library(prog, mesh)
  expected = {"expert_parallel", "expert_parallel_pipelined"} | ({"expert_tensor_parallel"} if mesh_name == "2x4"
                                                                  else set())
  assert set(lib) == expected
  names = sorted(lib)
  at = CASES.index(case)
  context = jax.set_mesh(mesh) if inside else contextlib.nullcontext()
  with context:
    args = [jax.device_put(x, NamedSharding(mesh, P())) for x in xs] if inside else xs
    for name in (names[(at + 1) % len(names)],):  # each schedule in turn, in every mesh shape
      s = lib[name]
      out, grads = forward_and_gradients(s.compile(), args, cot)
      assert rel_err(out, want) < 2e-5, name
      for g, w, b in zip(grads, want_grads, prog.reads):
        if top_k == 1 and b.name == "router":  # one gate: softmax gives 1 whatever the router
          assert not np.any(np.asarray(w)) and not np.any(np.asarray(g)), name
        else:
          assert rel_err(g, w) < 2e-5, (name, b.name)


def test_expert_parallel_lowers_to_all_to_all():
  mesh = make_mesh("8")
  prog = jm.programs.moe(64, 16, 24, 8, 2)
  s = jm.library(prog, mesh)["expert_parallel"]
  lowered = s.compile().lower(*prog.random_inputs(fresh_key()))
  assert "stablehlo.all_to_all" in lowered.as_text() and "all-to-all" in lowered.compile().as_text()
  printed = str(s)
  assert "AllToAll(x rows over x: dispatch" in printed and "AllGather" not in printed
  again = jm.Schedule.from_json(prog, mesh, s.to_json())
  assert str(again) == printed and json.loads(s.to_json())["steps"][-1]["primitive"] == "dispatch"


def test_tokens_the_mesh_does_not_divide_and_the_dense_gemm():
  mesh = make_mesh("8")
  prog = jm.programs.moe(60, 16, 24, 8, 2, capacity_factor=0.75)
  xs = inputs(prog, biased=False)
  want = dense_moe(*xs, top_k=2, capacity_factor=0.75)
  s = jm.Schedule(prog, mesh).pad("t", 8).tile("e", 8).parallelize("e0", "x").dispatch("e0", gemm="dense")
  assert rel_err(s.compile()(*xs), want) < 2e-5
  assert rel_err(jm.library(prog, mesh)["expert_parallel"].compile()(*xs), want) < 2e-5


def test_cost_memory_and_autotune(tmp_path):
  """The cost model and memory estimate price dispatched schedules statically; autotune runs on the program."""
  mesh = jax.sharding.AbstractMesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
  big = jm.programs.moe(8192, 1024, 2048, 16, 2, capacity_factor=1.25, dtype=jnp.bfloat16)
  machine = jm.tuner.cost.Machine("h", 5e14, {"*": 1e11, "gpu": 4e11})
  lib = jm.library(big, mesh)
  dense = jm.Schedule(big, mesh).tile("e", 4).parallelize("e0", "gpu").tile("f", 2).parallelize("f0", "node")
  for s in lib.values():
    assert 0 < jm.tuner.cost.predict(s, machine) < jm.tuner.cost.predict(dense, machine)
    assert jm.tuner.cost.backward_seconds(s, machine) > 0
    assert memory_per_device(s) > 0
  ep = lib["expert_parallel"]
  assert memory_per_device(ep) < memory_per_device(dense)
  assert memory_per_device(lib["expert_parallel_pipelined"]) < memory_per_device(ep)
  prog = jm.programs.moe(64, 16, 24, 8, 2, capacity_factor=1.0)
  result = jm.autotune(prog, make_mesh("8"), machine=machine, iters=1, space=0, top_k=1,
                       database=jm.Database(str(tmp_path / "moe.db")), log=lambda *a: None)
  assert result.best.result.status == "ok"
  gemms = {c.schedule.dispatched["gemm"] for c in result.candidates if c.strategy == "expert_parallel"}
  assert gemms == {"ragged_dot", "dense"}  # the tuner chooses the grouped GEMM
  plain = {c.strategy for c in result.candidates if c.origin == "plain"}
  assert any("einsum_dispatch" in name for name in plain), plain  # never slower than the plain MoE


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_flax_moe_layer_routed_by_distribute(kind, tmp_path):
  """``models.mixtral``'s einsum-dispatch MoE equals the dense reference; ``jm.distribute`` routes the block's MoE
  layer to ``ops.moe`` (expert parallel): outputs, gradients and three Adam steps as undecorated, every type equal
  (``model_checks.train_alike``); the instance distributed keeps its own ``moe_fn``."""
  import dataclasses  # noqa: I001  (flax and the models, for this test only)
  from flax import nnx
  from model_checks import train_alike
  from models.mixtral import CONFIGS, MixtralBlock, einsum_moe

  prog = jm.programs.moe(48, 16, 24, 8, 2, capacity_factor=0.5)
  xs = inputs(prog, biased=False)
  assert rel_err(einsum_moe(*xs, top_k=2, capacity_factor=0.5), dense_moe(*xs, top_k=2, capacity_factor=0.5)) < 1e-6
  mesh = make_mesh("8", kind)
  config = dataclasses.replace(CONFIGS["tiny"], capacity_factor=1.0)

  def loss(m, x):
    y = m(x)
    return jnp.mean(y ** 2), y

  with jax.set_mesh(mesh):
    plain = MixtralBlock(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(fresh_key(), (2, 32, config.dim))
    db = jm.Database(str(tmp_path / "moe.db"))
    routed = jm.distribute(nnx.clone(plain), mesh=mesh, database=db, attention=False, linear=False)
    assert isinstance(routed.moe.moe_fn, jm.flax.MoeFn) and plain.moe.moe_fn is einsum_moe
    assert store_library_winners(db, lambda: nnx.eval_shape(lambda m, x: m(x), routed, x)) == 1  # untuned: plain
    train_alike(plain, routed, loss, (x,), mesh=mesh, out_tol=2e-5, grad_tol=2e-4)


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
  """``jax.lax.ragged_all_to_all``'s semantics from all-gathers (XLA:CPU does not run the op itself)."""
  del recv_sizes  # implied by the senders' sizes
  me = jax.lax.axis_index(axis_name)
  ops, ins, sends, outs = (jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                                       output_offsets))
  rows = jnp.arange(output.shape[0])
  result = output
  for src in range(ops.shape[0]):
    start, size, lands = ins[src, me], sends[src, me], outs[src, me]
    mine = (rows >= lands) & (rows < lands + size)
    taken = jnp.take(ops[src], jnp.clip(start + rows - lands, 0, ops.shape[1] - 1), axis=0)
    result = jnp.where(mine.reshape((-1,) + (1,) * (output.ndim - 1)), taken, result)
  return result


@pytest.mark.parametrize("mesh_name,cf", [("8", 0.5), ("2x4", None)])
def test_ragged_exchange(mesh_name, cf, monkeypatch):
  """``dispatch(exchange="ragged")``: its lowered program holds ``ragged_all_to_all``; with the op emulated from
  all-gathers (XLA:CPU does not run it), its offsets give the dense reference's output and gradients."""
  mesh = make_mesh(mesh_name)
  prog = jm.programs.moe(64, 16, 24, 16, 2, capacity_factor=cf)
  level = mesh.axis_names[-1]
  s = jm.Schedule(prog, mesh).tile("e", mesh.shape[level]).parallelize("e0", level).dispatch("e0", exchange="ragged")
  xs = inputs(prog, biased=True)
  text = jax.jit(jax.grad(lambda *a: jnp.sum(s.compile()(*a) ** 2), argnums=(0, 1, 2))).lower(*xs).as_text()
  assert "ragged_all_to_all" in text
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  want, want_grads = forward_and_gradients(lambda *a: dense_moe(*a, top_k=2, capacity_factor=cf), xs, cot)
  out, grads = forward_and_gradients(s.compile(), xs, cot)
  assert rel_err(out, want) < 2e-5
  assert all(rel_err(g, w) < 2e-5 for g, w in zip(grads, want_grads))


def test_ragged_strategy_on_gpu_meshes_only():
  """``expert_parallel_ragged`` is offered where ragged_all_to_all runs (GPU meshes), priced below the padded one."""
  big = jm.programs.moe(8192, 1024, 2048, 16, 2, dtype=jnp.bfloat16)
  gpus = h100_mesh(8)
  lib = jm.library(big, gpus)
  assert "expert_parallel_ragged" in lib and "expert_parallel_ragged" not in jm.library(big, make_mesh("8"))
  assert lib["expert_parallel_ragged"].dispatched["exchange"] == "ragged"
  assert "ragged" in str(lib["expert_parallel_ragged"])
  machine = jm.tuner.cost.Machine("h", 5e14, {"*": 5e10})
  assert jm.tuner.cost.predict(lib["expert_parallel_ragged"], machine) < jm.tuner.cost.predict(
      lib["expert_parallel"], machine)
