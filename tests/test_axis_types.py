"""Every public path on meshes of Explicit, Auto and mixed axis types, inside and outside ``jax.set_mesh``.

``jax.make_mesh`` gives Explicit axes by default: shardings are then part of
arrays' types. Library schedules forward and backward, padded shapes,
``jm.ops``, ``jm.distribute`` (Linear on N-D inputs, LinearGeneral,
MultiHeadAttention, a caller's ``out_sharding``) and training, the tuner and
the graph search run on each, with inputs made inside and outside
``jax.set_mesh``; routed results carry the type the undecorated operation
gives; calls inside ``jax.sharding.auto_axes`` route on the region's types;
and no decorated training step makes XLA rematerialize a tensor (a
subprocess reads the compiler's log).
"""

import contextlib
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from conftest import (
  MESH_SHAPES,
  fresh_key,
  rel_err,
  store_library_winners,
)
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from model_checks import store_winners, train_alike

import jaxmercury as jm
from jaxmercury._cpu_flags import cpu_flags
from jaxmercury.tuner import cost

AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
MACHINE = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)


def _mesh(name: str, kind: str):
  shape, names = MESH_SHAPES[name]
  types = (AxisType.Explicit, AxisType.Auto) if kind == "mixed" else (AXIS_TYPES[kind],) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types[:len(shape)])


def _inputs(prog, mesh, where):
  """Fresh inputs made outside ``jax.set_mesh`` (no mesh in their type), or inside it, placed on the mesh."""
  if where == "outside":
    return prog.random_inputs(fresh_key())
  with jax.set_mesh(mesh):
    return [jax.device_put(x, NamedSharding(mesh, P())) for x in prog.random_inputs(fresh_key())]


def _context(mesh, where):
  return jax.set_mesh(mesh) if where == "inside" else contextlib.nullcontext()


def _spec(x):
  """``x``'s PartitionSpec without trailing unsplit dimensions: ``P(None, "x", None)`` is ``P(None, "x")``."""
  spec = list(jax.typeof(x).sharding.spec)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def _grads(f, xs, cot):
  return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=tuple(range(len(xs)))))(*xs)


CASES = [("8", "explicit", "outside"), ("8", "explicit", "inside"), ("2x4", "explicit", "inside"),
         ("4x2", "explicit", "outside"), ("8", "auto", "inside"), ("2x4", "auto", "outside"),
         ("2x4", "mixed", "inside")]


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_library_schedules_forward_and_backward(case):
  """Every library strategy runs in some case (two per case, in turn), each case on its own mesh and types."""
  mesh_name, kind, where = CASES[case]
  mesh = _mesh(mesh_name, kind)
  prog = jm.programs.attention(1, 8, 2, 64, 64, 16, causal=True)
  xs = _inputs(prog, mesh, where)
  host = [jax.device_get(x) for x in xs]
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  want = prog.reference(*host)
  want_grads = jax.grad(lambda *a: jnp.sum(prog.reference(*a) * cot), argnums=(0, 1, 2))(*host)
  lib = jm.library(prog, mesh)
  names = sorted(lib)
  for name in (names[case % len(names)], names[(case + 3) % len(names)]):
    f = lib[name].compile()
    with _context(mesh, where):
      out = f(*xs)
      grads = _grads(f, xs, cot)
    assert rel_err(out, want) < 2e-5, name
    for g, w, x in zip(grads, want_grads, xs):
      assert rel_err(g, w) < 2e-5, name
      if kind != "auto" and where == "inside":  # a cotangent has its primal's type
        assert _spec(g) == _spec(x), name


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_one_device_library_gradients(where):
  """One device of Explicit axes (``jax.make_mesh((1,), ...)``, one GPU's mesh): every strategy's layouts name an
  axis of size 1, which the caller's arrays do not say; the backward (one fused call per device) reshards into
  them (it failed shard_map's check of its inputs before)."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
  prog = jm.programs.attention(1, 4, 2, 64, 64, 16, causal=True)
  xs = _inputs(prog, mesh, where)
  host = [jax.device_get(x) for x in xs]
  cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
  want = jax.grad(lambda *a: jnp.sum(prog.reference(*a) * cot), argnums=(0, 1, 2))(*host)
  for name, schedule in jm.library(prog, mesh).items():
    with _context(mesh, where):
      grads = _grads(schedule.compile(), xs, cot)
    assert all(rel_err(g, w) < 2e-5 for g, w in zip(grads, want)), name


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_padded_axes_whose_output_is_split(kind):
  """Lengths the mesh does not divide: the crop of a split dimension leaves it whole, inside ``set_mesh``."""
  mesh = _mesh("8", kind)
  attention = jm.programs.attention(1, 8, 2, 97, 97, 16)
  gemm = jm.programs.matmul(100, 300, 72)
  for prog, names in ((attention, ("ring",)), (gemm, ("allgather_matmul", "matmul_reducescatter"))):
    xs = _inputs(prog, mesh, "inside")
    cot = jax.random.normal(fresh_key(), prog.writes.shape, jnp.float32)
    host = [jax.device_get(x) for x in xs]
    want_grads = jax.grad(lambda *a: jnp.sum(prog.reference(*a) * cot), argnums=tuple(range(len(xs))))(*host)
    for name in names:
      f = jm.library(prog, mesh)[name].compile()
      with jax.set_mesh(mesh):
        out = f(*xs)
        grads = _grads(f, xs, cot)
      assert rel_err(out, prog.reference(*host)) < 2e-5, name
      assert all(rel_err(g, w) < 2e-5 for g, w in zip(grads, want_grads)), name
      if kind == "explicit":  # the cropped dimension is whole; the others keep the stored split
        assert None in jax.typeof(out).sharding.spec or jax.typeof(out).sharding.spec == P()


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_ops_results_have_the_undecorated_type(kind, tmp_path):
  mesh = _mesh("8", kind)
  db = jm.Database(str(tmp_path / "ops.db"))
  with jax.set_mesh(mesh):
    q = jax.device_put(jax.random.normal(fresh_key(), (1, 64, 8, 16)), NamedSharding(mesh, P(None, "x")))
    k, v = (jax.random.normal(fresh_key(), (1, 64, 2, 16)) for _ in range(2))
    a, b = jax.random.normal(fresh_key(), (64, 48)), jax.random.normal(fresh_key(), (48, 32))
    run = lambda q, k, v, a, b: (jm.ops.attention(q, k, v, mesh=mesh, database=db),
                                 jm.ops.matmul(a, b, mesh=mesh, database=db))
    want_o = jax.nn.dot_product_attention(q, k, v)
    want_c = a @ b
    untuned = run(q, k, v, a, b)  # the plain programs
    assert store_library_winners(db, lambda: jax.eval_shape(run, q, k, v, a, b)) == 2
    tuned = run(q, k, v, a, b)  # ring attention, all-gather GEMM
  for o, c in (untuned, tuned):
    assert rel_err(o, want_o) < 2e-5 and rel_err(c, want_c) < 2e-5
    if kind == "explicit":
      assert _spec(o) == _spec(want_o) and _spec(c) == _spec(want_c)


class _Block(nnx.Module):
  """MultiHeadAttention, a Linear on a 3-D input, a LinearGeneral, and a Linear given an ``out_sharding``."""

  def __init__(self, d, heads, rngs, out_sharding=None):
    self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=d, qkv_features=d, decode=False,
                                            rngs=rngs)
    self.up = nnx.Linear(d, 4 * d, rngs=rngs)
    self.down = nnx.LinearGeneral(4 * d, (d,), rngs=rngs)
    self.out = nnx.Linear(d, d, rngs=rngs)
    self.out_sharding = out_sharding

  def __call__(self, x):
    x = x + self.attention(x)
    x = x + self.down(jax.nn.gelu(self.up(x)))
    return self.out(x, out_sharding=self.out_sharding) if self.out_sharding is not None else self.out(x)


def _mse(model, x):
  y = model(x)
  return jnp.mean(y ** 2), y


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_distributed_model_matches_forward_and_three_optax_steps(kind, tmp_path):
  """MultiHeadAttention, Linear on N-D inputs, LinearGeneral and a caller's ``out_sharding`` routed: outputs,
  gradients and three Adam steps as undecorated, every type equal (``model_checks.train_alike``)."""
  mesh = _mesh("8", kind)
  db = jm.Database(str(tmp_path / "flax.db"))
  wanted = P(None, "x") if kind == "explicit" else None  # a caller's out_sharding (types need Explicit axes)
  with jax.set_mesh(mesh):
    plain = _Block(64, 4, nnx.Rngs(0), wanted)
    x = jax.device_put(jax.random.normal(fresh_key(), (2, 32, 64)), NamedSharding(mesh, P()))
    store_winners(db, mesh, jm.explain(plain, x, mesh=mesh, database=db))
    routed = jm.distribute(nnx.clone(plain), mesh=mesh, database=db)
    trained = train_alike(plain, routed, _mse, (x,), mesh=mesh, lower=True)
  assert "collective_permute" in trained.text  # jaxmercury's ring ran


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_tuner_and_graph_search(kind):
  from models import CONFIGS, DecoderBlock
  from models import block_graph as bg
  mesh = _mesh("8", kind)
  prog = jm.programs.matmul(64, 32, 48)
  result = jm.autotune(prog, mesh, space=2, top_k=1, iters=2, machine=MACHINE, log=lambda line: None)
  assert result.best is not None and not [c for c in result.candidates if c.status == "failed"]
  config = CONFIGS["tiny"]
  plan = jm.graph.search(bg.block_graph(config, batch=1, seq=64, mesh=mesh, machines=MACHINE), MACHINE)
  f, _ = bg.planned_block(plan)
  params = bg.block_params(DecoderBlock(config, rngs=nnx.Rngs(0)))
  x = jax.random.normal(fresh_key(), (1, 64, config.dim))
  for where in ("outside", "inside"):
    with _context(mesh, where):
      y = jax.jit(f)(params, x)
    assert rel_err(y, bg.block_apply(params, x, config)) < 1e-5


REMAT_CHECK = textwrap.dedent("""
    import os, sys, tempfile
    import jax, jax.numpy as jnp, optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from flax import nnx
    import jaxmercury as jm, models
    from jaxmercury.flax import replicate_state
    sys.path.insert(0, "tests")
    from conftest import store_library_winners
    from test_axis_types import _Block

    kind = AxisType.Explicit if sys.argv[1] == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
    db = jm.Database(os.path.join(tempfile.mkdtemp(), "t.db"))
    with jax.set_mesh(mesh):
      config = models.CONFIGS["tiny"]
      llama = replicate_state(jm.distribute(models.Llama(config, rngs=nnx.Rngs(0)), mesh=mesh, database=db), mesh)
      opt = replicate_state(models.make_optimizer(llama), mesh)
      tokens = models.random_tokens(jax.random.key(1), 2, 32, config.vocab)
      assert store_library_winners(db, lambda: jm.explain(llama, tokens[:, :-1]))  # routed: library schedules
      models.train_step(llama, opt, tokens, mesh=mesh)
      block = jm.distribute(_Block(64, 4, nnx.Rngs(0)), mesh=mesh, database=db)
      x = jax.device_put(jax.random.normal(jax.random.key(2), (2, 32, 64)), NamedSharding(mesh, P()))
      assert store_library_winners(db, lambda: jm.explain(block, x))
      nnx.jit(lambda m, x: m(x))(block, x)
      optimizer = nnx.Optimizer(block, optax.adamw(1e-3), wrt=nnx.Param)

      @nnx.jit
      def step(m, opt, x):
        value, grads = nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(m, x)
        opt.update(m, grads)
        return value
      step(block, optimizer, x)
    print("steps ran")
""")


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_decorated_training_steps_rematerialize_nothing(kind):
  """XLA logs "Involuntary full rematerialization" for each tensor it must replicate and re-split: none, in the
  decorated Llama's and MultiHeadAttention + Linear model's forward and training steps."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags("", 8)}
  run = subprocess.run([sys.executable, "-c", REMAT_CHECK, kind], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0 and "steps ran" in run.stdout, run.stderr[-3000:]
  assert "rematerialization" not in run.stderr, [line for line in run.stderr.splitlines() if "remat" in line][:3]


class _AutoRegion(nnx.Module):
  """Attention and a projection inside ``jax.sharding.auto_axes`` on a mesh of Explicit axes: the region's
  arrays are Auto-typed, the caller's outside it Explicit."""

  def __init__(self, d, heads, rngs):
    self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
    self.heads = heads

  def __call__(self, x):
    def region(x, kernel):
      q, k, v = jnp.split((x @ kernel).reshape(*x.shape[:2], 3 * self.heads, -1), 3, axis=2)
      return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jax.sharding.auto_axes(region, out_sharding=P("x"))(x, self.qkv.kernel[...])


def test_routes_inside_auto_axes_on_an_explicit_mesh(tmp_path):
  """A model's auto_axes region routes on the mesh retyped as the region's (Auto): forward, gradients and three
  Adam steps as undecorated, the ring really run."""
  mesh = _mesh("8", "explicit")
  db = jm.Database(str(tmp_path / "region.db"))
  with jax.set_mesh(mesh):
    plain = _AutoRegion(32, 4, nnx.Rngs(0))
    x = jax.device_put(jax.random.normal(fresh_key(), (8, 16, 32)), NamedSharding(mesh, P("x")))
    assert store_library_winners(db, lambda: jm.explain(plain, x, mesh=mesh, database=db)) == 2
    assert all(e.routed for e in jm.explain(plain, x, mesh=mesh, database=db))
    routed = jm.distribute(nnx.clone(plain), mesh=mesh, database=db)
    trained = train_alike(plain, routed, _mse, (x,), mesh=mesh, lower=True)
  assert "collective_permute" in trained.text
