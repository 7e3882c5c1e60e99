"""Graph-level search and communication fusion: values, bytes counted in the lowered HLO, plans."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, make_mesh, rel_err
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury import graph as jg
from jaxmercury.analysis import collectives as cl
from jaxmercury.analysis import fusion, hlo
from jaxmercury.analysis.collectives import Collective as C
from jaxmercury.analysis.layouts import Layout
from jaxmercury.graph.search import BACKWARD_FACTOR, node_seconds
from jaxmercury.lowering import collectives as run_collectives
from jaxmercury.tuner import cost, measure

MACHINE = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
AR, RS, AG, A2A, SLICE, SCALE = cl.ALL_REDUCE, cl.REDUCE_SCATTER, cl.ALL_GATHER, cl.ALL_TO_ALL, cl.SLICE, cl.SCALE


def mesh4():
  return jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])


def lay(*dims, partial=()):
  return Layout(tuple(tuple(d) for d in dims), tuple(partial))


# (rule, mesh, source layout, shape, unfused collectives, fused collectives, fused/unfused bytes at N = 4)
RULE_CASES = {
    "allreduce_slice_is_reducescatter": (
        "4", lay((), (), partial=["x"]), (16, 8), [C(AR, "x"), C(SLICE, "x", 0)], [C(RS, "x", 0)], 0.5),
    "allgather_slice_cancels": (
        "4", lay(["x"], ()), (16, 8), [C(AG, "x", 0), C(SLICE, "x", 0)], [], 0.0),
    "allgather_slice_is_alltoall": (
        "4", lay(["x"], ()), (16, 8), [C(AG, "x", 0), C(SLICE, "x", 1)], [C(A2A, "x", 0, 1)], 1 / 4),
    "alltoall_alltoall_compose": (
        "4", lay(["x"], (), ()), (8, 8, 8), [C(A2A, "x", 0, 1), C(A2A, "x", 1, 2)], [C(A2A, "x", 0, 2)], 0.5),
    "allgather_reducescatter_is_scale": (
        "4", lay(["x"], ()), (16, 8), [C(AG, "x", 0), C(RS, "x", 0)], [C(SCALE, "x")], 0.0),
}


def _program(mesh, src: Layout, seq):
  """A shard_map taking ``src`` (a partial source arrives as one slice per rank) through ``seq``."""
  sizes = dict(mesh.shape)
  dst = cl.trajectory(src, seq)[-1]
  if src.partial:
    (level,) = src.partial
    in_spec = P(level, *src.spec)

    def body(x):
      return run_collectives.run(x[0], seq, sizes)
  else:
    in_spec = src.spec

    def body(x):
      return run_collectives.run(x, seq, sizes)

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=dst.spec, check_vma=False))


def _mesh(name):
  return mesh4() if name == "4" else make_mesh(name)


@pytest.mark.parametrize("rule", sorted(RULE_CASES))
def test_fusion_rule_values_and_lowered_bytes(rule):
  mesh_name, src, shape, unfused, expected, ratio = RULE_CASES[rule]
  mesh = _mesh(mesh_name)
  sizes = dict(mesh.shape)
  fused, applied = fusion.fuse(src, unfused)
  assert applied == [rule] and fused == expected
  n = sizes["x"]
  x = jax.random.normal(fresh_key(), ((n,) if src.partial else ()) + shape, jnp.float32)
  want = x.sum(0) if src.partial else x * (n if rule == "allgather_reducescatter_is_scale" else 1)
  outputs, counted = [], []
  for seq in (unfused, fused):
    f = _program(mesh, src, seq)
    outputs.append(f(x))
    counted.append(hlo.collective_bytes(f.lower(x).as_text()))
    assert counted[-1] == pytest.approx(cl.sequence_bytes(src, seq, shape, 4, sizes)), seq
  np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(outputs[0], want, rtol=1e-5, atol=1e-5)
  assert counted[1] == pytest.approx(ratio * counted[0])


def test_fusion_commutes_steps_of_other_levels_on_two_level_mesh():
  """TP over gpu + SP over both levels: all-reduce meets its slice across the node steps."""
  mesh = make_mesh("2x4")
  src, dst = lay(["node"], (), partial=["gpu"]), lay(["node"], ["gpu"])
  naive = cl.naive(src, dst)
  assert naive == [C(AR, "gpu"), C(AG, "node", 0), C(SLICE, "node", 0), C(SLICE, "gpu", 1)]
  fused, applied = fusion.fuse(src, naive)
  assert fused == [C(RS, "gpu", 1)]
  assert sorted(applied) == ["allgather_slice_cancels", "allreduce_slice_is_reducescatter"]
  x = jax.random.normal(fresh_key(), (4, 16, 8), jnp.float32)
  outs = [_program(mesh, src, seq)(x) for seq in (naive, fused)]
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(outs[1], x.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pair,src", [
    ([C(AG, "x", 0), C(SLICE, "gpu", 0)], lay(["x"], ())),  # different levels
    ([C(AR, "x"), C(SLICE, "gpu", 0)], lay((), (), partial=["x"])),  # different levels
    ([C(A2A, "x", 0, 1), C(A2A, "gpu", 2, 0)], lay(["x"], (), ["gpu"])),  # different levels
    ([C(AG, "x", 0), C(RS, "x", 1)], lay(["x"], ())),  # gather and scatter along different dims
    # cancelling the outer pair would have to move a slice of another level across it on the same dim
    ([C(AG, "x", 0), C(SLICE, "gpu", 0), C(SLICE, "x", 0)], lay(["x"], ())),
])
def test_rules_refuse_when_preconditions_fail(pair, src):
  fused, rule = fusion.fuse_once(src, pair)
  assert rule is None and fused == pair


def test_tp_sp_transition_moves_half_the_bytes_in_lowered_schedules():
  """k-parallel GEMM then a sequence-split consumer: all-reduce + slice (unfused) vs reduce-scatter (fused)."""
  from jaxmercury.graph.options import _without_output_placement
  mesh = mesh4()
  prog = jm.programs.matmul(64, 32, 48)
  fused = jm.library(prog, mesh)["matmul_reducescatter"]
  unfused = _without_output_placement(fused).with_layouts(None, P("x", None))
  a, b = prog.random_inputs(fresh_key())
  texts = [s.compile().lower(a, b).as_text() for s in (unfused, fused)]
  kinds = [[c.kind for c in hlo.collectives(t)] for t in texts]
  assert kinds == [["all_reduce"], ["reduce_scatter"]]
  moved = [hlo.collective_bytes(t) for t in texts]
  assert moved[1] == pytest.approx(0.5 * moved[0])
  np.testing.assert_allclose(unfused.compile()(a, b), fused.compile()(a, b), rtol=1e-6, atol=1e-6)
  # the volume formulas: all-reduce 2(N-1)/N, reduce-scatter (N-1)/N of the float32 partial C
  state = 64 * 32 * 4
  assert moved == pytest.approx([2 * 3 / 4 * state, 3 / 4 * state])


def test_fused_edges_never_move_more_than_needed():
  """Over every pair of layouts on a 2x4 mesh: fused <= naive, and <= jaxmercury's own resharding steps."""
  sizes = {"node": 2, "gpu": 4}
  shape = (16, 8)
  layouts = jg.enumerate_layouts(shape, sizes)
  sources = layouts + [Layout(lay_.dims, (lv,)) for lay_ in layouts for lv in sizes if lv not in lay_.levels]
  checked = 0
  for src, dst in itertools.product(sources, layouts):
    naive = cl.naive(src, dst)
    fused, _ = fusion.fuse(src, naive)
    assert cl.trajectory(src, fused)[-1] == dst
    fused_bytes = cl.sequence_bytes(src, fused, shape, 2, sizes)
    assert fused_bytes <= cl.sequence_bytes(src, naive, shape, 2, sizes) + 1e-9
    if not src.partial:
      direct = cl.steps(src, dst)
      assert fused_bytes <= cl.sequence_bytes(src, direct, shape, 2, sizes) + 1e-9, (src, dst, fused, direct)
    checked += 1
  assert checked > 100


def test_views_carry_layouts_across_reshapes():
  sizes = {"x": 8}
  tokens_split = lay(["x"], ())
  assert jg.view(tokens_split, (64, 64), (1, 64, 4, 16), sizes) == lay((), ["x"], (), ())
  assert jg.view(lay((), ["x"]), (64, 64), (1, 64, 8, 8), sizes) == lay((), (), ["x"], ())
  assert jg.view(lay((), ["x"]), (64, 64), (1, 64, 4, 16), sizes) is None  # 4 heads cannot split 8 ways
  assert jg.view(lay(["x"], ()), (64, 64), (2, 32, 4, 16), sizes) is None  # tokens are batch-major
  assert jg.view(lay(["x"], (), (), ()), (16, 4, 4, 16), (64, 64), sizes) == lay(["x"], ())


def _mlp_graph(mesh, tokens=64, dim=32, hidden=64):
  """x -> norm -> (gate, up) -> swiglu -> down -> + x: small enough to enumerate."""
  g = jg.Graph(mesh)
  common = dict(mesh=mesh, machines=MACHINE)
  res = Layout((("x",), ()))
  g.add(jg.input_node("x", (tokens, dim), jnp.float32, res))
  g.add(jg.glue_node("norm", lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True), ["x"], (tokens, dim),
                     jnp.float32, allowed=lambda lay_: not lay_.dims[1], **common))
  for name in ("gate", "up"):
    g.add(jg.op_node(name, jm.programs.matmul(tokens, hidden, dim), inputs={"A": "norm"}, params={"B": name},
                     **common))
  g.add(jg.glue_node("act", lambda a, b: jax.nn.silu(a) * b, ["gate", "up"], (tokens, hidden), jnp.float32,
                     **common))
  g.add(jg.op_node("down", jm.programs.matmul(tokens, dim, hidden), inputs={"A": "act"}, params={"B": "down"},
                   **common))
  g.add(jg.glue_node("residual", jnp.add, ["x", "down"], (tokens, dim), jnp.float32, **common))
  g.add(jg.output_node("y", "residual", (tokens, dim), jnp.float32, res))
  return g


def test_dynamic_programming_matches_exhaustive_search():
  mesh = make_mesh("8")
  g = _mlp_graph(mesh)
  assert 100 < g.space_size() <= 4096
  exact, dp = jg.exhaustive(g, MACHINE), jg.dynamic(g, MACHINE)
  assert dp.seconds == pytest.approx(exact.seconds)
  assert jg.search(g, MACHINE).method == "exhaustive search"
  assert jg.search(g, MACHINE, exhaustive_limit=10).method.startswith("dynamic")
  # a plan's total is its operators plus its edges, and no fixed assignment beats it
  assert dp.seconds == pytest.approx(dp.node_seconds + dp.edge_seconds)
  naive_tp = {n.name: n.candidates[0] for n in g.nodes}
  assert jg.fixed(g, MACHINE, naive_tp).seconds >= exact.seconds - 1e-12


def test_block_plan_is_printed_runs_and_matches_the_block():
  import models
  from models import block_graph as bg
  mesh = make_mesh("8")
  config = models.CONFIGS["tiny"]
  graph = bg.block_graph(config, batch=1, seq=64, mesh=mesh, machines=MACHINE)
  plan = jg.search(graph, MACHINE)
  assert plan.method.startswith("dynamic")
  text = str(plan)
  print(text)
  for node in ("wq", "attention", "wo", "w_gate", "w_down"):
    assert f"  {node} " in text
  assert "edges (after fusion" in text
  for e in plan.edges:
    assert e.fused_bytes <= e.naive_bytes
    assert all(a.kind != AR or b.kind != SLICE for a, b in zip(e.fused, e.fused[1:]))
  block = models.DecoderBlock(config, rngs=nnx.Rngs(0))
  params = bg.block_params(block)
  f, specs = bg.planned_block(plan)
  assert set(specs) <= set(bg.PARAMS)
  x = jax.random.normal(fresh_key(), (1, 64, config.dim), jnp.float32)
  cot = jax.random.normal(fresh_key(), x.shape, jnp.float32)

  def loss(run):
    def value(p, x):
      y = run(p, x)
      return jnp.sum(y * cot), y
    return jax.jit(jax.value_and_grad(value, argnums=(0, 1), has_aux=True))

  (_, y), grads = loss(f)(params, x)
  (_, want), want_grads = loss(lambda p, x: bg.block_apply(p, x, config))(params, x)
  assert rel_err(y, want) < 1e-5
  assert rel_err(want, block(x)) < 1e-6
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    assert rel_err(got, ref) < 1e-4

def test_candidates_take_measured_times_from_the_database(tmp_path):
  from jaxmercury.graph.options import op_candidates
  from jaxmercury.tuner import measure
  from jaxmercury.tuner.candidates import Candidate as Tuned
  mesh = make_mesh("8")
  prog = jm.programs.matmul(64, 32, 48)
  db = jm.Database(str(tmp_path / "graph.db"))
  winner = Tuned("allgather_matmul", jm.library(prog, mesh)["allgather_matmul"], 1.0, 0,
                 measure.Measurement(measure.OK, 7.0))
  db.store(prog, mesh, winner, [winner])
  found = {c.name: c for c in op_candidates(prog, mesh, MACHINE, activations=["A"], database=db)}
  assert found["allgather_matmul"].source == "database"
  # the measured 7 ms, less the share of the input all-gather that moves onto the edge
  assert 0 < found["allgather_matmul"].seconds <= 7e-3
  assert found["async_tp"].source == "predicted"


def test_measured_candidates_replace_predictions_and_plan():
  """Every operator candidate is timed on the mesh; identical nodes share their timings; the plan still runs."""
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
  g = _mlp_graph(mesh, tokens=32, dim=16, hidden=32)
  lines = []
  timed = jg.measure_candidates(g, MACHINE, iters=2, key=fresh_key(), log=lines.append)
  assert [n.name for n in timed.nodes] == [n.name for n in g.nodes]
  assert len(lines) == 2 and lines[0].startswith("gate: ") and lines[1].startswith("down: ")  # up shares gate's
  for before, after in zip(g.nodes, timed.nodes):
    if before.kind == "op":
      assert [c.name for c in after.candidates] == [c.name for c in before.candidates]
      assert all(c.source == "measured" and c.seconds >= 0 for c in after.candidates)
      assert any(c.seconds != p.seconds for c, p in zip(after.candidates, before.candidates))
    else:
      assert after.candidates == before.candidates
  gate, up = timed.node("gate"), timed.node("up")
  assert [c.seconds for c in gate.candidates] == [c.seconds for c in up.candidates]
  plan = jg.search(timed, MACHINE)
  assert "(measured)" in str(plan)
  x = jax.random.normal(fresh_key(), (32, 16), jnp.float32)
  params = {name: jax.random.normal(fresh_key(), shape, jnp.float32)
            for name, shape in (("gate", (16, 32)), ("up", (16, 32)), ("down", (32, 16)))}
  y = jg.compile_plan(plan)({"x": x}, params)["y"]
  h = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  want = x + (jax.nn.silu(h @ params["gate"]) * (h @ params["up"])) @ params["down"]
  assert rel_err(y, want) < 1e-5


def test_measured_training_steps_replace_the_backward_factor(monkeypatch):
  """training=True also times each candidate's forward and backward; a training search prices the node by it."""
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
  g = _mlp_graph(mesh, tokens=32, dim=16, hidden=32)
  calls = []
  real = measure.interleaved
  monkeypatch.setattr(measure, "interleaved", lambda *a, **k: calls.append(k.get("cotangent_key")) or real(*a, **k))
  lines = []
  timed = jg.measure_candidates(g, MACHINE, iters=2, key=fresh_key(), log=lines.append, training=True)
  assert len(calls) == 4 and sum(c is not None for c in calls) == 2  # gate (up shares it) and down, both ways
  assert [line.split(":")[0] for line in lines] == ["gate", "gate forward + backward", "down",
                                                    "down forward + backward"]
  for node in timed.nodes:
    for c in node.candidates if node.kind == "op" else ():
      assert c.train_seconds is not None and c.train_seconds > 0
      assert node_seconds(c, training=True) == c.train_seconds
      assert node_seconds(c, training=False) == c.seconds
  cache, calls[:] = {}, []
  forward_only = jg.measure_candidates(g, MACHINE, iters=2, key=fresh_key(), log=lambda _: None, cache=cache)
  assert all(c.train_seconds is None for n in forward_only.nodes for c in n.candidates)
  again = jg.measure_candidates(g, MACHINE, iters=2, key=fresh_key(), log=lambda _: None, cache=cache, training=True)
  assert len(calls) == 4  # the forward timings were kept: only the training steps were timed
  assert [c.seconds for c in again.node("gate").candidates] == [c.seconds for c in forward_only.node("gate").candidates]
  plan = jg.search(timed, MACHINE, training=True)
  assert "forward + backward" in str(plan) and "(measured)" in str(plan)
  assert plan.node_seconds == pytest.approx(sum(c.train_seconds for n, c in plan.choice.items()
                                                if timed.node(n).kind == "op") +
                                            sum(node_seconds(c, True) for n, c in plan.choice.items()
                                                if timed.node(n).kind != "op"))


def test_a_training_step_is_timed_with_its_gradients(monkeypatch):
  """interleaved(cotangent_key=...) times the schedule's vjp: what it runs returns the output and the gradients of
  A and B (the data-parallel GEMM's weight gradient all-reduced over the devices)."""
  prog = jm.programs.matmul(256, 128, 64)
  s = jm.library(prog, make_mesh("8"))["data_parallel"]
  a, b = prog.random_inputs(fresh_key())
  key = fresh_key()
  ran = []
  real = measure.rounds
  monkeypatch.setattr(measure, "rounds", lambda calls, counts, on_error=None:
                      ran.extend(c() for c in calls.values()) or real(calls, counts))
  out = measure.interleaved({"dp": s}, (a, b), iters=2, cotangent_key=key)
  assert len(out["dp"]) == 2 and all(t > 0 for t in out["dp"])
  cot = jax.random.normal(key, (256, 128), jnp.float32)
  y, da, db = ran[0]
  assert rel_err(y, a @ b) < 1e-5 and rel_err(da, cot @ b.T) < 1e-5 and rel_err(db, a.T @ cot) < 1e-5


def test_fused_lowerings_are_candidates_and_their_plan_runs():
  """On a mesh where fused kernels run (here one CPU device, interpreted), a strategy's fused variant is a
  candidate of its own; a plan made of fused candidates runs and matches the plain MLP."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  dt, tokens, dim, hidden = jnp.bfloat16, 64, 64, 128
  g = jg.Graph(mesh)
  res = Layout((("x",), ()))
  g.add(jg.input_node("x", (tokens, dim), dt, res))
  ops = dict(mesh=mesh, machines=MACHINE, fused_lowerings=True)
  g.add(jg.op_node("up", jm.programs.matmul(tokens, hidden, dim, dtype=dt), inputs={"A": "x"}, params={"B": "up"},
                   **ops))
  g.add(jg.op_node("down", jm.programs.matmul(tokens, dim, hidden, dtype=dt), inputs={"A": "up"},
                   params={"B": "down"}, **ops))
  g.add(jg.output_node("y", "down", (tokens, dim), dt, res))
  names = {n.name: [c.name for c in n.candidates] for n in g.nodes if n.kind == "op"}
  assert "async_tp <fused_allgather_matmul>" in names["up"]
  assert "matmul_reducescatter <fused_matmul_reducescatter>" in names["down"]
  # two strategies the same kernel runs with the same layouts give one candidate
  assert not any(n.startswith("async_tp_reducescatter <") for n in names["down"])
  plain = jg.op_node("up", jm.programs.matmul(tokens, hidden, dim, dtype=dt), inputs={"A": "x"},
                     params={"B": "up"}, mesh=mesh, machines=MACHINE)
  assert not any("<" in c.name for c in plain.candidates)  # by default: only where they run natively

  def pick(node, name):
    return next(c for c in g.node(node).candidates if c.name == name)
  choice = {n.name: n.candidates[0] for n in g.nodes}
  choice.update(up=pick("up", "async_tp <fused_allgather_matmul>"),
                down=pick("down", "matmul_reducescatter <fused_matmul_reducescatter>"))
  plan = jg.fixed(g, MACHINE, choice)
  assert "<fused_matmul_reducescatter>" in str(plan)
  params = {name: (jax.random.normal(fresh_key(), shape, jnp.float32) / 8).astype(dt)
            for name, shape in (("up", (dim, hidden)), ("down", (hidden, dim)))}
  x = jax.random.normal(fresh_key(), (tokens, dim), jnp.float32).astype(dt)
  cot = jax.random.normal(fresh_key(), (tokens, dim), jnp.float32)
  run = jg.compile_plan(plan).fn

  def loss(f):
    def value(p):
      y = f(p)
      return jnp.sum(y.astype(jnp.float32) * cot), y
    return jax.jit(jax.value_and_grad(value, has_aux=True))

  (_, y), grads = loss(lambda p: run({"x": x}, p)["y"])(params)
  (_, want), want_grads = loss(lambda p: (x @ p["up"]) @ p["down"])(params)
  assert y.dtype == dt and rel_err(y.astype(jnp.float32), want.astype(jnp.float32)) < 2e-2
  for name in params:
    assert rel_err(grads[name].astype(jnp.float32), want_grads[name].astype(jnp.float32)) < 2e-2


def test_training_objective_prices_replicated_weights_gradients():
  """data_parallel keeps the weights whole and splits the rows: no communication forward, but every device holds
  a partial weight gradient to all-reduce in training. The training objective counts it (and the backward), so
  it can prefer another plan than the forward objective."""
  from jaxmercury.graph.options import grad_sync_seconds, op_candidates
  mesh = make_mesh("8")
  prog = jm.programs.matmul(256, 512, 512)
  found = {c.name: c for c in op_candidates(prog, mesh, MACHINE, activations=["A"])}
  weight = 512 * 512 * 4  # B whole on every device, float32
  want = 2 * weight * 7 / 8 / 1e9 + 50e-6
  dp = found["data_parallel"]  # the all-reduce beside its own backward: the machine's overlap share hides
  assert dp.backward_seconds > 0 and MACHINE.overlap == 1.0
  assert dp.grad_sync_seconds == pytest.approx(want - min(want, dp.backward_seconds))
  assert grad_sync_seconds(dp.schedule, ["B"], MACHINE) == pytest.approx(want)
  half = dataclasses.replace(MACHINE, overlap=0.5)
  dp_half = {c.name: c for c in op_candidates(prog, mesh, half, activations=["A"])}["data_parallel"]
  assert dp_half.grad_sync_seconds == pytest.approx(want - 0.5 * min(want, dp_half.backward_seconds))
  assert found["allgather_matmul"].grad_sync_seconds == 0.0  # B split: each device's gradient columns are whole
  assert found["async_tp"].grad_sync_seconds == 0.0  # the rows travel the ring: every device sees all of them
  g = _mlp_graph(mesh)
  forward, training = jg.search(g, MACHINE), jg.search(g, MACHINE, training=True)
  assert training.training and not forward.training
  assert "training step" in str(training) and "forward" in str(forward)
  same = jg.fixed(g, MACHINE, forward.choice, training=True)
  assert training.seconds <= same.seconds + 1e-12  # the training plan is the best for training
  ops = [c for c in forward.choice.values() if c.backward_seconds is not None]  # operators: their predicted backward
  glue = [c for c in forward.choice.values() if c.backward_seconds is None]
  assert len(ops) == 3  # gate, up and down price their backward; the input, the glue and the output do not
  for c in ops:
    assert c.backward_seconds == pytest.approx(cost.backward_seconds(c.schedule, MACHINE))
  assert same.seconds == pytest.approx(sum(c.seconds + c.backward_seconds + c.grad_sync_seconds for c in ops)
                                       + sum(BACKWARD_FACTOR * c.seconds + c.grad_sync_seconds for c in glue)
                                       + 2 * forward.edge_seconds)


# ------------------------------------------------------------------ the block in plain JAX beside the plans
def _tiny_block(mesh, seq=64):
  import models
  from models import block_graph as bg
  config = models.CONFIGS["tiny"]
  plan = jg.search(bg.block_graph(config, batch=1, seq=seq, mesh=mesh, machines=MACHINE), MACHINE)
  params = bg.block_params(models.DecoderBlock(config, rngs=nnx.Rngs(int(jax.random.randint(fresh_key(), (), 0, 999)))))
  x = jax.random.normal(fresh_key(), (seq, config.dim), jnp.float32)
  return bg, config, plan, params, x


def test_the_block_in_plain_jax_stands_beside_the_plan_and_is_measured_the_same_way():
  """choose checks the plan and both Megatron blocks (gradients too) and times their training steps side by side:
  a plan is chosen only when faster than the best of them beyond the noise and the margin."""
  from jaxmercury.tuner import decide
  mesh = make_mesh("8")
  bg, config, plan, params, x = _tiny_block(mesh)
  wholes = bg.whole_blocks(config, mesh, batch=1, seq=64)
  assert [w.name for w in wholes] == ["xla_megatron_tp", "xla_megatron_tp_sp"]
  lines = []
  choice = jg.choose({"jaxmercury_plan": plan}, wholes, {"x": x}, params, training=True, iters=4, log=lines.append)
  assert not choice.failed, choice.failed
  assert {c.name for c in choice.contestants} == {"xla_megatron_tp", "xla_megatron_tp_sp", "jaxmercury_plan"}
  d = choice.decision
  assert set(d.times_ms) == {c.name for c in choice.contestants} and d.baseline in ("xla_megatron_tp",
                                                                                       "xla_megatron_tp_sp")
  if choice.plan is not None:
    assert choice.chosen.name == "jaxmercury_plan" and d.versus_baseline.slower(decide.PLAIN_MARGIN)
  else:
    assert choice.chosen.plain and choice.chosen.name in d.times_ms
  assert any(line.startswith("graph final round (training steps):") for line in lines)
  # What was chosen runs the block.
  f, specs = bg.chosen_block(choice)
  y = jax.jit(f)(params, x.reshape(1, 64, config.dim))
  assert rel_err(y, bg.block_apply(params, x.reshape(1, 64, config.dim), config)) < 1e-5
  assert set(specs) <= set(bg.PARAMS)


def test_a_plan_measured_slower_than_the_plain_block_is_not_chosen(monkeypatch):
  """The plan's function made to do its work many times over loses to the Megatron block; a whole program whose
  values differ is failed, not timed."""
  from jaxmercury.graph import whole
  mesh = make_mesh("8")
  bg, config, plan, params, x = _tiny_block(mesh)
  real = whole.compile_plan

  def slowed(p):
    compiled = real(p)

    def fn(inputs, params):
      again = lambda _, y: compiled.fn({"x": inputs["x"] + 0 * y["y"]}, params)
      return jax.lax.fori_loop(0, 20, again, compiled.fn(inputs, params))
    return dataclasses.replace(compiled, fn=fn)

  monkeypatch.setattr(whole, "compile_plan", slowed)
  (megatron, _) = bg.whole_blocks(config, mesh, batch=1, seq=64)
  wrong = jg.WholeProgram("wrong", lambda i, p: {"y": 1.01 * megatron.fn(i, p)["y"]}, megatron.param_specs)
  choice = jg.choose(plan, [megatron, wrong], {"x": x}, params, iters=4, log=lambda _: None)
  assert choice.chosen.name == "xla_megatron_tp" and choice.plan is None
  assert "wrong" in choice.failed and "relative error" in choice.failed["wrong"]
  assert choice.decision.times_ms["plan"] and choice.decision.median_ms("plan") > choice.decision.median_ms(
      "xla_megatron_tp")
  assert "xla_megatron_tp wins the final round" in choice.summary()
