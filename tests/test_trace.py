"""Schedule traces: JSON out, replay, identical printout and result; bad traces rejected."""

import json

import numpy as np
import pytest
from conftest import fresh_key, make_mesh

import jaxmercury as jm
from jaxmercury.tuner import enumerate_schedules


def _round_trip(schedule):
  prog, mesh = schedule.program, schedule.mesh
  text = schedule.to_json()
  again = jm.Schedule.from_json(prog, mesh, text)
  assert str(again) == str(schedule)
  assert again.to_json() == text
  xs = prog.random_inputs(fresh_key())
  np.testing.assert_array_equal(np.asarray(again.compile()(*xs)), np.asarray(schedule.compile()(*xs)))


@pytest.mark.parametrize("mesh_name,program", [("2x4", "attention"), ("8", "matmul")])
def test_library_round_trip(mesh_name, program):
  mesh = make_mesh(mesh_name)
  prog = jm.programs.attention(1, 8, 8, 32, 32, 8, causal=True) if program == "attention" else \
      jm.programs.matmul(32, 16, 24)
  for schedule in jm.library(prog, mesh).values():
    _round_trip(schedule)


def test_composed_round_trip():
  mesh = make_mesh("4x2")
  prog = jm.programs.weighted_sum(16, 32)
  for schedule in enumerate_schedules(prog, mesh)[::7]:
    _round_trip(schedule)


def _trace(prog, mesh):
  return json.loads(jm.library(prog, mesh)["ring"].to_json())


@pytest.mark.parametrize("corrupt,message", [
    (lambda d: d["steps"].append({"primitive": "exec", "args": ["x"]}), "unknown primitive 'exec'"),
    (lambda d: d["steps"].append({"primitive": "tile", "args": [{"a": 1}]}), "is not a name"),
    (lambda d: d["steps"].append({"primitive": "tile", "args": ["b"], "kwargs": {"evil": 1}}), "tile"),
    (lambda d: d["steps"].append({"primitive": "tile", "args": ["b", 2], "code": "1"}), "malformed"),
    (lambda d: d.update(format=99), "format"),
    (lambda d: d.update(mesh={"x": 4}), "mesh"),
    (lambda d: d["params"].update(q_len=16), "trace is for"),
])
def test_malformed_traces_are_rejected(corrupt, message):
  mesh = make_mesh("8")
  prog = jm.programs.attention(1, 8, 8, 32, 32, 8)
  data = _trace(prog, mesh)
  corrupt(data)
  with pytest.raises(jm.TraceError, match=message):
    jm.Schedule.from_json(prog, mesh, json.dumps(data))


def test_invalid_step_in_trace_raises_schedule_error():
  mesh = make_mesh("8")
  prog = jm.programs.matmul(32, 16, 24)
  data = json.loads(jm.library(prog, mesh)["async_tp"].to_json())
  data["steps"].insert(0, {"primitive": "tile", "args": ["m", 5], "kwargs": {}})
  with pytest.raises(jm.ScheduleError, match="factor must divide"):
    jm.Schedule.from_json(prog, mesh, json.dumps(data))
  with pytest.raises(jm.TraceError, match="not valid JSON"):
    jm.Schedule.from_json(prog, mesh, "{not json")
