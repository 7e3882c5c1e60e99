"""Test set-up: a simulated 8-device CPU platform, a compilation cache for the session, meshes and input helpers."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

from jaxmercury._cpu_flags import cpu_flags  # before JAX makes its CPU client, which reads XLA_FLAGS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On the simulated CPU devices, programs compile at LLVM's -O0 (XLA's own passes are unchanged, the code it emits
# plainer): the suite compiles far more than it computes, interpret-mode kernels above all (near half their time).
os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""), devices=8) + (
    " --xla_backend_optimization_level=0" if os.environ["JAX_PLATFORMS"] == "cpu"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") else "")

# JAX's persistent compilation cache, in a temporary folder named by the session's first process (pytest, or
# xdist's controller) and read from the environment, when JAX starts, by every process of the session: xdist's
# workers and the subprocesses of the tests (documents, notebooks, benchmark suites, tuner workers). A program
# compiled once, in any of them, is read back by the others (the key is the compiled module and its devices,
# not the Python function). A folder the caller names is used as it is, and kept.
os.environ.setdefault("JAXMERCURY_TESTS_SESSION", str(os.getpid()))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"jaxmercury-tests-compiled-{os.environ['JAXMERCURY_TESTS_SESSION']}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")  # most of the suite's programs

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType


def pytest_unconfigure(config):
  """The session's first process removes the compilation cache it named."""
  session = str(os.getpid())
  if os.environ["JAXMERCURY_TESTS_SESSION"] == session and os.environ["JAX_COMPILATION_CACHE_DIR"].endswith(
      f"jaxmercury-tests-compiled-{session}"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


MESH_SHAPES = {"8": ((8,), ("x",)), "2x4": ((2, 4), ("node", "gpu")), "4x2": ((4, 2), ("node", "gpu"))}


def make_mesh(name: str, axis_type=AxisType.Auto):
  shape, names = MESH_SHAPES[name]
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


@pytest.fixture(params=sorted(MESH_SHAPES))
def mesh(request):
  return make_mesh(request.param)


_seed = np.random.SeedSequence()


def fresh_key():
  """A new PRNG key for every call: inputs are fresh each run, never fixed."""
  return jax.random.key(int(_seed.spawn(1)[0].generate_state(1)[0]))


def tolerance(dtype):
  return {np.dtype(jnp.float32): 2e-5, np.dtype(jnp.bfloat16): 2e-2}[np.dtype(dtype)]


def rel_err(y, ref):
  y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def assert_grads_match(got, want, tol=1e-4):
  """Gradient pytrees, leaf by leaf, each relative to its own norm, or to a hundredth of the whole gradient's where
  a leaf's is next to nothing (a key bias under softmax has none: rounding is all there is)."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want)
  whole = np.sqrt(sum(np.linalg.norm(np.asarray(b, np.float64)) ** 2 for b in want))
  for a, b in zip(got, want):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), whole / 100)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_processes(script: str, argvs, *, devices: int, timeout: float = 300) -> list:
  """``python -c script PROCESS_ID PORT *argv``, one process per ``argv`` of ``argvs`` (ids 0, 1, ...; one free port
  for ``jax.distributed``), each on ``devices`` simulated CPU devices with the repository on its path; each must
  exit 0 within ``timeout`` seconds. Returns each one's report: the JSON after ``REPORT `` on its output."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
         "XLA_FLAGS": cpu_flags("", devices), "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, "-c", script, str(i), str(port), *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i, argv in enumerate(argvs)]
  try:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    outs = [p.communicate()[0] for p in procs]
    pytest.fail(f"the processes did not finish in {timeout} s:\n" + "\n".join(o[-3000:] for o in outs))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-5000:]
  return [json.loads(next(line[len("REPORT "):] for line in out.splitlines() if line.startswith("REPORT ")))
          for out in outs]


def adam_losses(loss, params, steps: int = 3, learning_rate: float = 1e-2) -> list[float]:
  """The losses of ``steps`` jitted ``optax.adam`` steps of ``loss(params)``, from ``params``."""
  tx = optax.adam(learning_rate)

  @jax.jit
  def step(p, state):
    value, grads = jax.value_and_grad(loss)(p)
    updates, state = tx.update(grads, state, p)
    return value, optax.apply_updates(p, updates), state

  p, state, losses = params, tx.init(params), []
  for _ in range(steps):
    value, p, state = step(p, state)
    losses.append(float(value))
  return losses


def assert_trains_alike(got, want):
  """Losses of a few optimizer steps, routed and plain. The first is a forward on equal parameters: tight. Adam
  then moves each element by about its learning rate whatever its gradient's size, so rounding in a near-zero
  gradient may move it either way: later losses agree loosely (compare gradients tightly apart). A loss that is a
  mean of terms of either sign may sit near zero, where float32 rounding of its terms is absolute, not relative."""
  assert got[0] == pytest.approx(want[0], rel=1e-5, abs=1e-6)
  assert got[1:] == pytest.approx(want[1:], rel=1e-3, abs=1e-5)
  assert want[-1] < want[0]


def assert_matches(schedule, inputs=None, reference=None):
  """Runs ``schedule`` and compares with the program's reference in float64 terms."""
  prog = schedule.program
  xs = inputs if inputs is not None else prog.random_inputs(fresh_key())
  ref = reference if reference is not None else jax.jit(prog.reference)(*xs)  # one compile, not one per op
  y = schedule.compile()(*xs)
  assert y.shape == ref.shape and y.dtype == ref.dtype
  assert np.all(np.isfinite(np.asarray(y, np.float32)))
  err = rel_err(y, ref)
  assert err < tolerance(prog.writes.dtype), f"rel err {err:.2e}\n{schedule}"


def pairwise(configs, fields=None) -> list:
  """The fewest of ``configs`` (dataclass instances, in order) that a greedy pick finds to cover every pair of two
  fields' values that some config has (and so every value): what a test of a kernel's interacting options runs,
  rather than their full product, each run being a whole kernel in the interpreter."""
  import dataclasses
  values = lambda c: [(f, getattr(c, f)) for f in fields or [x.name for x in dataclasses.fields(c)]]
  pairs = lambda c: {(a, b) for i, a in enumerate(values(c)) for b in values(c)[i + 1:]} | {(a,) for a in values(c)}
  wanted, chosen = set().union(*map(pairs, configs)), []
  while wanted:
    best = max(configs, key=lambda c: len(pairs(c) & wanted))
    chosen.append(best)
    wanted -= pairs(best)
  return chosen


# ------------------------------------------------------------------ lowering for GPUs that are not here
H100 = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")


def h100_mesh(devices: int):
  """An abstract one-level mesh ``("x",)`` of ``devices`` H100s (132 SMs each), for lowering without GPUs."""
  return jax.sharding.AbstractMesh((devices,), ("x",), axis_types=(AxisType.Auto,), abstract_device=H100)


def lower_for_gpus(fn, *specs, mesh) -> str:
  """``jit(fn)`` traced on ``specs`` under the abstract ``mesh`` and lowered for CUDA: the module's text.

  The lowering runs Mosaic GPU's own passes (layouts, barriers, shared
  memory: a kernel over 227 KiB fails here); it is no CUDA compile and no run.
  """
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def mosaic_kernels(text: str) -> int:
  """How many Mosaic GPU kernels a lowered module launches."""
  return text.count("custom_call @mosaic_gpu")


# ------------------------------------------------------------------ cuDNN stood in by XLA on CPU
_CUDNN_BIAS = -2.0 ** 41  # the bias JAX's cuDNN path gives pairs a boolean mask drops (bf16)


def _cudnn_scores(q, k, causal, window, keep):
  """cuDNN's masked, scaled scores [b, hk, g, i, j] in float32: its causal mask and sliding window drop pairs
  (-inf), a ``keep`` mask ([b or 1, heads or 1, i, j]) adds a large negative bias (finite: a row that keeps
  nothing gets a softmax over its biased scores, as cuDNN gives it)."""
  b, i, hk, g, d = q.shape
  j = k.shape[1]
  s = jnp.einsum("bihgd,bjhd->bhgij", q.astype(jnp.float32), k.astype(jnp.float32)) / np.sqrt(d)
  dist = jnp.arange(i)[:, None] - jnp.arange(j)[None, :]
  allowed = jnp.ones((i, j), bool)
  if causal:
    allowed = allowed & (dist >= 0)
  if window is not None:
    assert causal, "cuDNN's sliding window comes with its causal mask here"
    allowed = allowed & (dist < window)
  s = jnp.where(allowed, s, -jnp.inf)
  if keep is not None:
    assert keep.ndim == 4 and keep.shape[2:] == (i, j) and keep.shape[1] in (1, hk * g) and keep.shape[0] in (1, b)
    bias = jnp.where(keep, 0.0, _CUDNN_BIAS).reshape(keep.shape[0], -1, 1, i, j)
    s = s + (bias if keep.shape[1] == 1 else bias.reshape(keep.shape[0], hk, g, i, j))
  return s


def _cudnn_standin(q, k, v, causal=False, window=None, keep=None):
  """``cudnn_attention._cudnn``'s contract, in XLA (float32)."""
  s = _cudnn_scores(q, k, causal, window, keep)
  lse = jax.nn.logsumexp(s, axis=-1)
  out = jnp.einsum("bhgij,bjhd->bihgd", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
  return out.astype(q.dtype).astype(jnp.float32), jnp.transpose(lse, (0, 3, 1, 2))


def _cudnn_backward_standin(q, k, v, o, do, lse, causal=False, window=None, keep=None):
  """``cudnn_attention._cudnn_backward_masked``'s contract (cuDNN's backward math from a given o and lse), in
  XLA: an lse of -inf gives NaNs, as it would on cuDNN."""
  f32 = lambda x: x.astype(jnp.float32)
  scale = 1 / np.sqrt(q.shape[-1])
  s = _cudnn_scores(q, k, causal, window, keep)
  p = jnp.exp(s - jnp.transpose(lse, (0, 2, 3, 1))[..., None])
  delta = jnp.transpose(jnp.sum(f32(do) * f32(o), axis=-1), (0, 2, 3, 1))[..., None]
  ds = p * (jnp.einsum("bihgd,bjhd->bhgij", f32(do), f32(v)) - delta)
  dq = jnp.einsum("bhgij,bjhd->bihgd", ds, f32(k)) * scale
  dk = jnp.einsum("bhgij,bihgd->bjhd", ds, f32(q)) * scale
  dv = jnp.einsum("bhgij,bihgd->bjhd", p, f32(do))
  return dq, dk, dv


def _cudnn_kind(causal, window, keep) -> str:
  return "bias" if keep is not None else "window" if window is not None else "causal" if causal else "unmasked"


@pytest.fixture
def cpu_cudnn(monkeypatch):
  """The cuDNN attention kernels offered on CPU (any dtype), cuDNN's calls stood in by XLA; and the plain cuDNN
attention (``jax.nn.dot_product_attention(implementation="cudnn")``, bf16 and f16 as on GPUs) stood in by JAX's XLA
one, called in cuDNN's layouts (``Plain.layout``).

  Returns the list of the cuDNN calls that ran, recorded while running (branches traced but not taken do not
  count): ``"forward KIND"`` for each forward call, ``"backward"`` and ``"backward KIND"`` for each backward one,
  KIND its mask: ``unmasked``, ``causal``, ``window`` (causal with a sliding window) or ``bias``.
  """
  import dataclasses

  from jaxmercury.kernels import registry
  from jaxmercury.kernels.attention import cudnn as cudnn_attention
  from jaxmercury.programs import plain
  ran = []

  def forward(q, k, v, causal=False, window=None, keep=None):
    kind = _cudnn_kind(causal, window, keep)
    jax.debug.callback(lambda: ran.append(f"forward {kind}"))
    return _cudnn_standin(q, k, v, causal, window, keep)

  def backward(q, k, v, o, do, lse, causal=False, window=None, keep=None):
    kind = _cudnn_kind(causal, window, keep)
    jax.debug.callback(lambda: ran.extend(["backward", f"backward {kind}"]))
    return _cudnn_backward_standin(q, k, v, o, do, lse, causal, window, keep)
  monkeypatch.setattr(cudnn_attention, "_cudnn", forward)
  monkeypatch.setattr(cudnn_attention, "_cudnn_backward_masked", backward)
  for name in ("cudnn_attention", "cudnn_attention_dq", "cudnn_attention_dkv"):
    kernel = registry._KERNELS[name]
    monkeypatch.setitem(registry._KERNELS, name, dataclasses.replace(kernel, platforms=frozenset({"cpu"}), dtypes=None))
  cudnn, *others = plain.PLAIN["attention"]
  standin = dataclasses.replace(cudnn, make=plain._attention(plain.XLA),
                                why_not=lambda program, platform: plain._cudnn_why_not(program, "gpu"))
  monkeypatch.setitem(plain.PLAIN, "attention", (standin, *others))
  return ran


# ------------------------------------------------------------------ routes that run library schedules, untuned
LIBRARY_WINNERS = {"attention": ("ring", "context_parallel", "tree"), "matmul": ("allgather_matmul",),
                   "moe": ("expert_parallel",)}


def store_winner(db, program, mesh, schedule=None, layouts=None, training=False):
  """Stores ``schedule`` (default: the first of ``LIBRARY_WINNERS`` that applies, else the local loop nest) as the
  tuned winner of ``program`` on ``mesh`` for the caller's ``layouts``, as a tune stores one (with a made-up
  time): routes then run it without tuning. Returns the schedule."""
  import jaxmercury as jm
  from jaxmercury.tuner import measure
  from jaxmercury.tuner.database import FORWARD, TRAINING
  name = "given"
  if schedule is None:
    lib = jm.library(program, mesh)
    name = next((n for n in LIBRARY_WINNERS.get(program.pattern, ()) if n in lib), "local")
    schedule = lib.get(name) or jm.Schedule(program, mesh)
  winner = jm.tuner.Candidate(name, schedule, 1.0, 0, measure.Measurement(measure.OK, 1.0))
  db.store(program, mesh, winner, [winner], layouts, objective=TRAINING if training else FORWARD)
  return schedule


def store_library_winners(db, run) -> int:
  """Runs ``run()`` (a trace is enough: ``jm.explain``, ``jax.eval_shape``) and stores a library winner
  (``store_winner``) in ``db`` for every operator it asked ``jm.ops.choose`` about: what a test of routing needs
  for its routes to run real distributed schedules, where untuned they run the plain program. Returns how many
  operators it stored."""
  from jaxmercury import ops
  asked, real = {}, ops.choose

  def spy(program, mesh, *, layouts=None, **kwargs):
    asked[program, mesh, str(layouts), bool(kwargs.get("training"))] = layouts
    return real(program, mesh, layouts=layouts, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(ops, "choose", spy)
    run()
  for (program, mesh, _, training), layouts in asked.items():
    store_winner(db, program, mesh, layouts=layouts, training=training)
  return len(asked)


def routable(entry) -> bool:
  """Whether ``jm.explain``'s entry is routed, or would be once tuned (it runs plain, not tuned)."""
  return entry.routed or entry.reason.startswith("plain (not tuned")
