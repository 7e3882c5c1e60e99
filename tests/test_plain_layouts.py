"""The plain programs (what a user runs: ``jnp.dot``, JAX's attention, the MoE einsum dispatch, partitioned by XLA) in
every combination of caller layouts JAX accepts, on Explicit and Auto axes, inside and outside ``jax.set_mesh``.

On Explicit axes a user must say the output's sharding where JAX's types cannot (``x[M@x, K] . w[K, N@x]`` and
``x[M, K@x] . w[K@x, N]`` raised ShardingTypeError without it), and JAX's attention refuses sequence-split queries
and keys there: the plain programs pass ``out_sharding`` (``jnp.dot``) or let XLA partition the call
(``jax.sharding.auto_axes``). Each case compiles one small program and checks its values against the reference
and, on Explicit axes, its output's type.
"""

import contextlib
import itertools

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.tuner import measure
from jaxmercury.tuner.plain import as_written, plain_programs
from jaxmercury.tuner.reference import trial

KINDS = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
_MESHES = {}


def _mesh(kind: str, shape=(8,), names=("x",)):
  key = (kind, shape, names)
  if key not in _MESHES:
    _MESHES[key] = jax.make_mesh(shape, names, axis_types=(KINDS[kind],) * len(shape))
  return _MESHES[key]


def _full(spec, rank):
  return P(*(list(spec) + [None] * rank)[:rank])


_DATA = {}


def _data(prog, grads: bool):
  """Fresh inputs, a cotangent and the reference's output (and gradients) for ``prog``, made once per session:
  the reference costs more than a case's compile."""
  if (prog, grads) not in _DATA:
    host = prog.random_inputs(fresh_key())
    cot = jax.random.normal(fresh_key(), prog.writes.shape, prog.writes.dtype)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(prog.reference(*a) * cot), argnums=tuple(range(len(host)))))(*host) \
        if grads else None
    _DATA[prog, grads] = host, cot, jax.jit(prog.reference)(*host), want
  return _DATA[prog, grads]


def _check(plain, ins, inside: bool, grads: bool = False):
  """Runs ``plain`` on the inputs placed in ``ins``: its values against the reference, its output's type on
  Explicit axes; with ``grads``, every input's gradient against the reference's."""
  prog, mesh = plain.program, plain.mesh
  host, cot, reference, want = _data(prog, grads)
  f = plain.compile()
  with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
    xs = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(host, ins)]
    y = f(*xs)
    if grads:
      got = jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=tuple(range(len(xs))))(*xs)
  tol = measure.tolerance(prog.writes.dtype)
  assert rel_err(y, reference) < tol
  if any(t == AxisType.Explicit for t in mesh.axis_types) and plain.out_sharding is not None:
    assert jax.typeof(y).sharding.spec == _full(plain.out_sharding, y.ndim)
  if grads:
    for g, w, x in zip(got, want, xs):
      assert rel_err(g, w) < 10 * tol
      if any(t == AxisType.Explicit for t in mesh.axis_types):  # a cotangent has its primal's type
        assert jax.typeof(g).sharding.spec == jax.typeof(x).sharding.spec


# ------------------------------------------------------------------ GEMM: every layout of a, b and the output
GEMM = jm.programs.matmul(16, 24, 32)  # [16, 32] . [32, 24]
ROWS, COLS, WHOLE = P("x", None), P(None, "x"), P(None, None)
GEMM_CASES = list(itertools.product(KINDS, (WHOLE, ROWS, COLS), (WHOLE, ROWS, COLS), (WHOLE, ROWS, COLS)))


@pytest.mark.parametrize("n", range(len(GEMM_CASES)),
                         ids=[f"{k}-a{a}-b{b}-out{o}".replace(" ", "") for k, a, b, o in GEMM_CASES])
def test_plain_gemm_in_every_layout(n):
  kind, a, b, out = GEMM_CASES[n]
  (plain,) = plain_programs(GEMM, _mesh(kind), (a, b), out)
  _check(plain, (a, b), inside=n % 2 == 0)


TWO_LEVELS = [(P(("node", "gpu"), None), P(None, None), P(("node", "gpu"), None)),
              (P("node", "gpu"), P("gpu", None), P("node", None)),
              (P("gpu", None), P(None, "node"), P("gpu", "node")),
              (P(None, ("node", "gpu")), P(("node", "gpu"), None), P(None, None))]


@pytest.mark.parametrize("kind", KINDS)
def test_plain_gemm_on_two_levels(kind):
  mesh = _mesh(kind, (2, 4), ("node", "gpu"))
  for i, (a, b, out) in enumerate(TWO_LEVELS):
    (plain,) = plain_programs(GEMM, mesh, (a, b), out)
    _check(plain, (a, b), inside=i % 2 == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_gemms_train(kind):
  """The two GEMMs of a tensor-parallel layer, gradients included (a training tune differentiates them)."""
  for a, b, out in ((ROWS, COLS, ROWS), (COLS, ROWS, ROWS)):
    (plain,) = plain_programs(GEMM, _mesh(kind), (a, b), out)
    _check(plain, (a, b), inside=True, grads=True)


# ------------------------------------------------------------------ attention: q and k/v layouts, and the output
ATTENTION = jm.programs.attention(8, 16, 8, 16, 16, 8, causal=True)  # b8 h16 kv8 s16 t16 d8: GQA
ATTENTION_BF16 = jm.programs.attention(8, 16, 8, 16, 16, 8, causal=True, dtype=jnp.bfloat16)
LAYOUTS = {"whole": P(None, None, None, None), "batch": P("x", None, None, None), "seq": P(None, "x", None, None),
           "heads": P(None, None, "x", None)}
NAMES = list(LAYOUTS)
# every q and k/v layout; the output's in turn (each of the four for each q layout)
ATTENTION_CASES = [(kind, q, kv, NAMES[(NAMES.index(q) + NAMES.index(kv)) % len(NAMES)])
                   for kind, q, kv in itertools.product(KINDS, NAMES, NAMES)]


@pytest.mark.parametrize("n", range(len(ATTENTION_CASES)), ids=["-".join(c) for c in ATTENTION_CASES])
def test_plain_xla_attention_in_every_layout(n):
  kind, q, kv, out = ATTENTION_CASES[n]
  ins = (LAYOUTS[q], LAYOUTS[kv], LAYOUTS[kv])
  (plain,) = plain_programs(ATTENTION, _mesh(kind), ins, LAYOUTS[out])
  assert plain.plain.implementation == "xla"
  _check(plain, ins, inside=n % 2 == 0)


# every q layout with k/v alike, or split by sequence (what moves most: the sequence to the heads)
CUDNN_CASES = [(kind, q, kv) for kind, q in itertools.product(KINDS, NAMES) for kv in dict.fromkeys((q, "seq"))]


@pytest.mark.parametrize("n", range(len(CUDNN_CASES)), ids=["-".join(c) for c in CUDNN_CASES])
def test_plain_cudnn_attention_in_every_layout(cpu_cudnn, n):
  """cuDNN's plain attention (stood in on CPU) is called in batch and head layouts only, whatever the caller's; the
  output leaves in the caller's."""
  kind, q, kv = CUDNN_CASES[n]
  ins = (LAYOUTS[q], LAYOUTS[kv], LAYOUTS[kv])
  (plain, *_) = plain_programs(ATTENTION_BF16, _mesh(kind), ins, LAYOUTS[q])
  assert plain.plain.implementation == "cudnn"
  assert all(spec[1] is None and spec[3] is None for spec in plain.inner_shardings())
  _check(plain, ins, inside=n % 2 == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_plain_attention_trains_in_a_sequence_split(kind):
  (plain,) = plain_programs(ATTENTION, _mesh(kind), (LAYOUTS["seq"],) * 3, LAYOUTS["seq"])
  _check(plain, (LAYOUTS["seq"],) * 3, inside=kind == "explicit", grads=True)


# ------------------------------------------------------------------ MoE and the caller's own layouts
@pytest.mark.parametrize("kind", KINDS)
def test_plain_moe_einsum_dispatch(kind):
  prog = jm.programs.moe(16, 8, 16, 8, 2, capacity_factor=2.0)
  mesh = _mesh(kind)
  # tokens split and experts split (expert parallel); features split (tensor parallel)
  tokens, weights = (P("x", None), P("x", None, None)) if kind == "explicit" else (P(None, "x"), P(None, None, "x"))
  ins = (tokens, P(None, None), weights, weights, weights)
  (plain, *_) = plain_programs(prog, mesh, ins, tokens)
  assert plain.plain.name == "einsum_dispatch"
  _check(plain, ins, inside=kind == "explicit")


@pytest.mark.parametrize("kind", KINDS)
def test_as_written_leaves_unknown_layouts_to_xla(kind):
  """The plain program a caller's call stands for: the caller's layouts where given, nothing constrained where
  not; its output where none is asked is what XLA (or JAX's types) gives."""
  mesh = _mesh(kind)
  free = as_written(GEMM, mesh)
  assert free.in_shardings == (None, None) and free.out_sharding is None
  _check(free, (ROWS, WHOLE), inside=True)
  given = as_written(GEMM, mesh, (ROWS, COLS), ROWS)
  assert given.in_shardings == (ROWS, COLS) and given.out_sharding == ROWS
  _check(given, (ROWS, COLS), inside=False)
  again = jm.tuner.plain.runnable_from_json(GEMM, mesh, free.to_json())
  assert again.in_shardings == (None, None) and again.to_json() == free.to_json()


def test_a_training_step_with_segment_ids_is_checked_without_their_gradients():
  """A plain training step of packed attention: the segment ids' gradients (``float0``, no values) are left out of
  the check, the rest compared with the reference."""
  mesh = _mesh("explicit")
  prog = jm.programs.attention(1, 8, 8, 256, 256, 16, causal=True, segment_ids=True)
  seq = P(None, "x", None, None)
  (plain,) = plain_programs(prog, mesh, (seq,) * 3 + (P(None, "x"),) * 2, seq)
  inputs, cot, ref = trial(prog, int(jax.random.randint(fresh_key(), (), 0, 2 ** 30)), jax.devices()[0],
                           training=True)
  result = measure.measure(plain, inputs, ref, iters=2, cotangent=cot)
  assert result.status == measure.OK, result.reason
