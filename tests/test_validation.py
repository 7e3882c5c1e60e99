"""Invalid programs, meshes, layouts, inputs, schedules and traces: each raises the right error type, naming the problem.

Every case is checked before anything is traced or compiled: the error types
form one family (``jaxmercury.ScheduleError``) and the message names the axis,
buffer, primitive or mesh level and says what would be valid.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from jaxmercury.kernels import registry
from jaxmercury.schedules.validate import validate


def _mm(m=64, n=32, k=48, dtype=jnp.float32):
  return jm.programs.matmul(m, n, k, dtype=dtype)


def _sched(mesh_name="8", prog=None):
  return jm.Schedule(prog or _mm(), make_mesh(mesh_name))


def _axes():
  return jm.Axis("m", 8), jm.Axis("n", 4), jm.Axis("k", 6)


def _grid(kinds="ssr", reads=None, writes=None, reduction=jm.Sum(), body=lambda ctx, a, b: a @ b, loops=None):
  m, n, k = _axes()
  a = jm.match_buffer("A", (m, k), jnp.float32)
  b = jm.match_buffer("B", (k, n), jnp.float32)
  c = jm.match_buffer("C", (m, n), jnp.float32)
  return jm.grid(loops or (m, n, k), kinds, reads=reads if reads is not None else (a, b),
                 writes=writes if writes is not None else c, body=body, reduction=reduction)


def _buffers(**extra):
  m, n, k = _axes()
  return {"A": jm.match_buffer("A", (m, k), jnp.float32), "B": jm.match_buffer("B", (k, n), jnp.float32),
          "C": jm.match_buffer("C", (m, n), jnp.float32), **extra}


def _tiled_parallel(mesh_name="8"):
  s = _sched(mesh_name)
  size = dict(s.mesh.shape)["x" if mesh_name == "8" else "gpu"]
  return s.tile("m", size).parallelize("m0", "x" if mesh_name == "8" else "gpu")


def _abstract():
  return AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,))


def _inputs(*shapes, dtype=jnp.float32):
  return [jnp.ones(s, dtype) for s in shapes]


def _with_bf16_only_kernel():
  return registry.Kernel(name="test_bf16_only", patterns=frozenset({"matmul"}), dtypes=frozenset({np.dtype(jnp.bfloat16)}))


def _trace_data(schedule):
  return json.loads(schedule.to_json())


def _replay(data, prog=None, mesh_name="8"):
  return jm.Schedule.from_json(prog or _mm(), make_mesh(mesh_name), json.dumps(data))


def _mutate_loops(s):
  s.loops[0].extent = 3
  return s


def _drop_last_step(s):
  s.trace.pop()  # a copy: the schedule's own trace is read-only
  s._trace.pop()  # reaching into private state is caught by ``validate``
  return s


def _x64_program():
  m, k = jm.Axis("m", 8), jm.Axis("k", 4)
  a = jm.match_buffer("A", (m, k), np.float64)
  c = jm.match_buffer("C", (m,), np.float64)
  return jm.grid((m, k), "sr", reads=(a,), writes=c, body=lambda ctx, a: a.sum(-1), reduction=jm.Sum())


# (id, thunk, error type, regex the message must match)
CASES = [
    # ---------------------------------------------------------------- programs
    ("axis-zero-extent", lambda: jm.Axis("m", 0), jm.ProgramError, r"axis 'm' needs a positive integer extent, got 0"),
    ("axis-float-extent", lambda: jm.Axis("m", 2.5), jm.ProgramError, r"axis 'm' needs a positive integer extent"),
    ("axis-bad-name", lambda: jm.Axis("m n", 4), jm.ProgramError, r"axis name 'm n' must be a non-empty identifier"),
    ("buffer-bad-dtype", lambda: jm.match_buffer("A", _axes()[:2], "floaty"), jm.ProgramError,
     r"buffer 'A': 'floaty' is not a dtype; use a numeric type such as jnp.float32"),
    ("buffer-non-numeric-dtype", lambda: jm.match_buffer("A", _axes()[:2], object), jm.ProgramError,
     r"buffer 'A': dtype object is neither numeric nor bool"),
    ("buffer-dim-not-axis", lambda: jm.match_buffer("A", ("m", "k"), jnp.float32), jm.ProgramError,
     r"buffer 'A': each dimension must be an Axis or a tuple of Axes, got 'm'"),
    ("buffer-axis-twice", lambda: jm.match_buffer("A", (_axes()[0], _axes()[0]), jnp.float32), jm.ProgramError,
     r"buffer 'A' binds an axis twice: \['m', 'm'\]"),
    ("grid-kinds-letter", lambda: _grid(kinds="ssx"), jm.ProgramError, r"kinds 'ssx' must give one of 's'/'r'.*\['m', 'n', 'k'\]"),
    ("grid-kinds-length", lambda: _grid(kinds="sr"), jm.ProgramError, r"kinds 'sr' must give one of 's'/'r' for each of 3 loops"),
    ("grid-loops-not-axes", lambda: _grid(loops=("m", "n", "k")), jm.ProgramError, r"grid: loops must be Axis objects"),
    ("grid-read-not-buffer", lambda: _grid(reads=("A", _buffers()["B"])), jm.ProgramError,
     r"grid: reads must hold Buffers made by match_buffer, got str"),
    ("grid-reduction-not-reduction", lambda: _grid(reduction="sum"), jm.ProgramError,
     r"reduction must be a jaxmercury Reduction such as Sum\(\)"),
    ("grid-body-not-callable", lambda: _grid(body=None), jm.ProgramError, r"body must be callable as body\(ctx, \*blocks\)"),
    ("spatial-loop-not-in-output", lambda: _grid(writes=jm.match_buffer("C", (_axes()[0],), jnp.float32)),
     jm.ProgramError, r"spatial loop 'n' must index output 'C'"),
    ("reduction-loop-in-output", lambda: _grid(kinds="srr"), jm.ProgramError, r"reduction loop 'n' must not index output 'C'"),
    ("reduction-without-combine", lambda: _grid(reduction=None), jm.ProgramError, r"reduction loops need a reduction"),
    ("axis-two-extents", lambda: _grid(reads=(_buffers()["A"], jm.match_buffer("B", (jm.Axis("k", 7), _axes()[1]), jnp.float32))),
     jm.ProgramError, r"axis 'k' has extents 6 and 7"),
    ("buffer-names-clash", lambda: _grid(reads=(_buffers()["A"], jm.match_buffer("A", (_axes()[2], _axes()[1]), jnp.float32))),
     jm.ProgramError, r"buffer names must be unique, got \['A', 'A', 'C'\]"),
    ("loop-indexes-no-buffer", lambda: _grid(kinds="ssrr", loops=(*_axes(), jm.Axis("z", 2))), jm.ProgramError,
     r"loop 'z' indexes no buffer"),
    ("attention-heads", lambda: jm.programs.attention(1, 6, 4, 8, 8, 8), jm.ScheduleError,
     r"heads \(6\) must be a positive multiple of kv_heads \(4\)"),
    ("float64-without-x64", lambda: jm.Schedule(_x64_program(), make_mesh("8")), jm.ProgramError,
     r"buffer 'A' has dtype float64, which JAX computes as float32 while jax_enable_x64 is off"),
    ("schedule-of-non-program", lambda: jm.Schedule("matmul", make_mesh("8")), jm.ProgramError,
     r"Schedule needs a jaxmercury Program, got str"),
    # ---------------------------------------------------------------- meshes
    ("mesh-not-a-mesh", lambda: jm.Schedule(_mm(), "mesh"), jm.MeshError, r"Schedule needs a jax.sharding.Mesh"),
    ("compile-abstract-mesh", lambda: jm.Schedule(_mm(), _abstract()).compile(), jm.MeshError,
     r"an AbstractMesh has no devices"),
    ("autotune-abstract-mesh", lambda: jm.autotune(_mm(), _abstract(), log=lambda s: None), jm.MeshError,
     r"an AbstractMesh has no devices"),
    ("parallelize-unknown-level", lambda: _sched().tile("m", 8).parallelize("m0", "rack"), jm.UnknownLevelError,
     r"parallelize\('m0', 'rack'\): mesh has no level 'rack'; levels: \['x'\]"),
    ("schedule-for-other-mesh", lambda: validate(_mm(), make_mesh("4x2"), schedule=_tiled_parallel("2x4")), jm.MeshError,
     r"schedule was built for mesh levels \{'node': 2, 'gpu': 4\}.*level 'node' has size 2 there and 4 here"),
    ("schedule-for-other-program", lambda: validate(_mm(32, 32, 32), schedule=_sched()), jm.ScheduleError,
     r"schedule is for matmul\(A\[m, k\], B\[k, n\]\) -> C\[m, n\] over \[m:64s"),
    # ---------------------------------------------------------------- layouts
    ("in-shardings-count", lambda: jm.Schedule(_mm(), make_mesh("8"), in_shardings=[P()]), jm.LayoutError,
     r"in_shardings needs one entry per input of matmul \(2: A, B\), got 1"),
    ("in-shardings-bare-spec", lambda: jm.Schedule(_mm(), make_mesh("8"), in_shardings=P("x")), jm.LayoutError,
     r"in_shardings needs a list with one PartitionSpec \(or None\) per input"),
    ("in-sharding-not-spec", lambda: jm.Schedule(_mm(), make_mesh("8"), in_shardings=["x", None]), jm.LayoutError,
     r"in_shardings for A must be a PartitionSpec \(or None\), got str"),
    ("in-sharding-too-long", lambda: jm.Schedule(_mm(), make_mesh("8"), in_shardings=[P("x", None, None), None]),
     jm.LayoutError, r"has more entries than A\[m, k\] has dimensions \(2\)"),
    ("in-sharding-level-twice", lambda: jm.Schedule(_mm(), make_mesh("2x4"), in_shardings=[P("gpu", "gpu"), None]),
     jm.LayoutError, r"mesh level 'gpu' is used twice"),
    ("in-sharding-uneven", lambda: jm.Schedule(_mm(60), make_mesh("8"), in_shardings=[P("x"), None]), jm.LayoutError,
     r"in_shardings for A: dimension 0 \(m, extent 60\) does not divide evenly over \('x',\) \(8 devices\)"),
    ("in-sharding-unknown-level", lambda: jm.Schedule(_mm(), make_mesh("8"), in_shardings=[P("y"), None]),
     jm.UnknownLevelError, r"in_shardings for A: mesh has no level 'y'; levels: \['x'\]"),
    ("out-sharding-unknown-level", lambda: jm.Schedule(_mm(), make_mesh("2x4"), out_sharding=P(None, "rack")),
     jm.UnknownLevelError, r"out_sharding for C: mesh has no level 'rack'; levels: \['node', 'gpu'\]"),
    ("out-sharding-uneven", lambda: jm.Schedule(_mm(64, 12), make_mesh("8"), out_sharding=P(None, "x")), jm.LayoutError,
     r"out_sharding for C: dimension 1 \(n, extent 12\) does not divide evenly"),
    ("autotune-bad-layout", lambda: jm.autotune(_mm(), make_mesh("8"), in_shardings=[P("z"), None], log=lambda s: None),
     jm.UnknownLevelError, r"in_shardings for A: mesh has no level 'z'"),
    # ---------------------------------------------------------------- inputs
    ("inputs-count", lambda: _sched().compile()(*_inputs((64, 48))), jm.InputError,
     r"matmul takes 2 inputs \(A, B\), got 1"),
    ("inputs-shape", lambda: _sched().compile()(*_inputs((32, 48), (48, 32))), jm.InputError,
     r"input A: expected shape \(64, 48\) for A\[m, k\], got \(32, 48\)"),
    ("inputs-dtype", lambda: _sched().compile()(jnp.ones((64, 48)), jnp.ones((48, 32), jnp.bfloat16)), jm.InputError,
     r"input B: expected dtype float32, got bfloat16"),
    ("inputs-not-arrays", lambda: validate(_mm(), make_mesh("8"), inputs=["A", jnp.ones((48, 32))]), jm.InputError,
     r"input A: expected an array of shape \(64, 48\) and dtype float32, got str"),
    ("inputs-not-a-list", lambda: validate(_mm(), make_mesh("8"), inputs=jnp.ones((64, 48))), jm.InputError,
     r"inputs must be a list or tuple of arrays \(A, B\)"),
    ("inputs-off-mesh", lambda: validate(_mm(), jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,),
                                                              devices=jax.devices()[:4]),
                                         inputs=[jax.device_put(jnp.ones((64, 48)), jax.devices()[7]), jnp.ones((48, 32))]),
     jm.InputError, r"input A is committed to devices \[7\] outside the mesh \(devices \[0, 1, 2, 3\]\)"),
    # ---------------------------------------------------------------- schedule primitives
    ("tile-uneven", lambda: _sched().tile("n", 3), jm.PreconditionError,
     r"tile\('n', 3\): factor must divide the loop's extent 32; pad\('n', 3\) first"),
    ("tile-distributed", lambda: _tiled_parallel().tile("m0", 2), jm.PreconditionError,
     r"tile\('m0'\): loop is distributed; tile before parallelize/shift"),
    ("tile-bad-name", lambda: _sched().tile("m", 2, names=("m 0", "m1")), jm.PreconditionError,
     r"loop name 'm 0' must be a non-empty identifier"),
    ("join-different-axes", lambda: _sched().tile("m", 4).join("m0", "n"), jm.PreconditionError,
     r"join\('m0', 'n'\): loops iterate different axes \('m', 'n'\)"),
    ("reorder-parallel-inside", lambda: _tiled_parallel().reorder("k", "m0"), jm.PreconditionError,
     r"parallel loop 'm0' would sit inside loop 'k'; parallel loops stay outside"),
    ("shift-along-serial", lambda: _sched().tile("m", 8).tile("n", 8).shift("m0", "n0"), jm.PreconditionError,
     r"shift\('m0', 'n0'\): 'n0' is not a parallel loop"),
    ("shard-on-serial-loop", lambda: _sched().tile("m", 8).shard("B", "m0"), jm.PreconditionError,
     r"shard: loop 'm0' is not parallel \(serial\); parallelize it onto a mesh level first"),
    ("replicate-unknown-buffer", lambda: _tiled_parallel().replicate("Z", "m0"), jm.UnknownNameError,
     r"matmul has no buffer 'Z'; buffers: \['A', 'B', 'C'\]"),
    ("pad-after-tile", lambda: _sched().tile("m", 4).pad("m", 8), jm.PreconditionError,
     r"pad\('m'\): pad an axis before tiling or distributing it"),
    ("pad-zero-multiple", lambda: _sched().pad("m", 0), jm.PreconditionError,
     r"pad\('m'\): multiple must be a positive int, got 0"),
    ("parallelize-extent", lambda: _sched("2x4").parallelize("m", "gpu"), jm.PreconditionError,
     r"parallelize\('m', 'gpu'\): loop extent 64 must equal the size 4 of mesh level 'gpu'; tile\('m', 4\) first"),
    ("patch-unknown-kernel", lambda: _sched().patch("flash9"), jm.UnknownNameError, r"patch: no local kernel 'flash9'; local kernels:"),
    ("patch-wrong-pattern", lambda: _sched().patch("cudnn_attention"), jm.PreconditionError,
     r"patch\('cudnn_attention'\): kernel implements \['attention'\]: matmul does not match loop-nest pattern 'attention'"),
    ("patch-wrong-dtype", lambda: _sched().patch("test_bf16_only"), jm.PreconditionError,
     r"patch\('test_bf16_only'\): kernel accepts \['bfloat16'\], program has \['float32'\]"),
    # ---------------------------------------------------------------- traces
    ("schedule-changed-behind-its-trace", lambda: jm.validate.validate(_mm(), schedule=_mutate_loops(_sched())),
     jm.TraceError, r"schedule and its trace disagree on loops"),
    ("trace-step-dropped", lambda: jm.validate.validate(_mm(), schedule=_drop_last_step(_tiled_parallel())),
     jm.TraceError,
     r"schedule and its trace disagree on loops.*change schedules only through their primitives"),
    ("trace-steps-not-list", lambda: _replay({**_trace_data(_sched()), "steps": {"tile": 1}}), jm.TraceError,
     r"trace steps must be a list"),
    ("trace-unknown-primitive", lambda: _replay({**_trace_data(_sched()), "steps": [{"primitive": "__import__", "args": ["os"]}]}),
     jm.TraceError, r"trace step 0: unknown primitive '__import__'"),
    ("trace-for-other-program", lambda: _replay(_trace_data(_sched()), prog=_mm(32, 32, 32)), jm.TraceError,
     r"trace is for 'matmul' \{'dtype': 'float32', 'k': 48, 'm': 64, 'n': 32\}, not 'matmul' \{'m': 32"),
]


@pytest.fixture
def bf16_only_kernel(monkeypatch):
  monkeypatch.setitem(registry._KERNELS, "test_bf16_only", _with_bf16_only_kernel())


@pytest.mark.parametrize("thunk,error,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_input_raises_named_error(bf16_only_kernel, thunk, error, message):
  with pytest.raises(error, match=message) as info:
    thunk()
  assert isinstance(info.value, jm.ScheduleError)


def test_there_are_at_least_thirty_cases():
  assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


def test_error_families_can_be_caught_together():
  with pytest.raises(jm.MeshError):
    _sched().tile("m", 8).parallelize("m0", "rack")  # an unknown level is a MeshError ...
  with pytest.raises(KeyError):
    _sched().tile("m", 8).parallelize("m0", "rack")  # ... and, like every unknown name, a KeyError
  for cls in (jm.ProgramError, jm.MeshError, jm.LayoutError, jm.InputError, jm.PreconditionError, jm.TraceError,
              jm.UnknownNameError, jm.UnknownLevelError):
    assert issubclass(cls, jm.ScheduleError) and issubclass(cls, ValueError)


def test_valid_schedule_validates_and_returns_its_plan():
  s = jm.library(_mm(), make_mesh("2x4"))["async_tp"]
  xs = _mm().random_inputs(jax.random.key(0))
  plan = validate(s.program, s.mesh, schedule=s, inputs=xs, compiling=True)
  assert plan.rings  # async_tp is a ring
  validate(s.program, s.mesh, inputs=[jax.device_put(x, s.mesh.devices.flat[3]) for x in xs])


def test_autotune_fails_invalid_candidates_and_goes_on():
  prog, mesh = _mm(), make_mesh("8")
  lib = jm.library(prog, mesh)
  other_mesh = jm.library(prog, make_mesh("2x4"))["allgather_matmul"]
  other_prog = jm.library(_mm(32, 32, 32), mesh)["allgather_matmul"]
  broken = _drop_last_step(lib["allgather_matmul"].copy())
  pairs = [("good", lib["allgather_matmul"]), ("other mesh", other_mesh), ("other program", other_prog),
           ("broken", broken)]
  from jaxmercury.tuner import cost
  machine = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
  result = jm.autotune(prog, mesh, candidates=pairs, iters=1, machine=machine, log=lambda s: None)
  by_name = {c.name: c for c in result.candidates}
  assert by_name["good"].status == "ok" and result.best in (by_name["good"], result.baseline)  # the plain one ties
  assert by_name["other mesh"].result.reason.startswith("invalid: schedule was built for mesh levels")
  assert by_name["other program"].result.reason.startswith("invalid: schedule is for matmul")
  assert by_name["broken"].result.reason.startswith("invalid: schedule and its trace disagree")
  assert all(by_name[n].status == "failed" for n in ("other mesh", "other program", "broken"))
