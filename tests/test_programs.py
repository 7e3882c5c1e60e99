"""Shipped programs: their plain references against independent formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, rel_err

import jaxmercury as jm


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_reference_matches_jax(heads, kv_heads, causal):
  prog = jm.programs.attention(2, heads, kv_heads, 48, 40, 16, causal=causal)
  q, k, v = prog.random_inputs(fresh_key())
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  assert rel_err(jax.jit(prog.reference)(q, k, v), ref) < 1e-5


def test_matmul_and_weighted_sum_references():
  prog = jm.programs.matmul(24, 40, 32)
  a, b = prog.random_inputs(fresh_key())
  assert rel_err(prog.reference(a, b), np.asarray(a, np.float64) @ np.asarray(b, np.float64)) < 1e-6
  prog = jm.programs.weighted_sum(16, 24)
  a, b = prog.random_inputs(fresh_key())
  assert rel_err(prog.reference(a, b), np.asarray(a, np.float64) @ np.asarray(b, np.float64)) < 1e-6


def test_user_program_with_dsl():
  i, j = jm.Axis("i", 12), jm.Axis("j", 20)
  x = jm.match_buffer("X", (i, j), jnp.float32)
  y = jm.match_buffer("Y", (i,), jnp.float32)
  prog = jm.grid((i, j), "sr", reads=(x,), writes=y, body=lambda ctx, x: jnp.sum(x * x, axis=1),
                 reduction=jm.Sum(), name="row_norm2")
  (xv,) = prog.random_inputs(fresh_key())
  np.testing.assert_allclose(prog.reference(xv), np.sum(np.asarray(xv) ** 2, axis=1), rtol=1e-5)


def test_dsl_rejects_bad_declarations():
  i, j = jm.Axis("i", 4), jm.Axis("j", 6)
  with pytest.raises(jm.ScheduleError, match="positive integer extent"):
    jm.Axis("k", 0)
  with pytest.raises(jm.ScheduleError, match="binds an axis twice"):
    jm.match_buffer("A", (i, i), jnp.float32)
  a = jm.match_buffer("A", (i, j), jnp.float32)
  c = jm.match_buffer("C", (i,), jnp.float32)
  with pytest.raises(jm.ScheduleError, match="reduction loop 'i' must not index output"):
    jm.grid((i, j), "rr", reads=(a,), writes=c, body=None, reduction=jm.Sum())
  with pytest.raises(jm.ScheduleError, match="need a reduction"):
    jm.grid((i, j), "sr", reads=(a,), writes=c, body=None)
  with pytest.raises(jm.ScheduleError, match="multiple of kv_heads"):
    jm.programs.attention(1, 6, 4, 8, 8, 8)
  prog = jm.programs.matmul(8, 8, 8)
  with pytest.raises(jm.ScheduleError, match="input B: expected shape"):
    prog.reference(jnp.ones((8, 8)), jnp.ones((4, 8)))


def test_operators_declare_their_parameters():
  """Each shipped operator builds its program from its declared parameters (defaults where not given); a value
  outside a parameter's declaration, an unknown name or a bad declaration is refused, naming it."""
  assert [op.name for op in jm.programs.operators()][:3] == ["attention", "matmul", "moe"]
  for op in jm.programs.operators():
    prog = op.program()
    assert prog.pattern == op.name and prog.params["dtype"] == "float32"
  prog = jm.programs.find_operator("attention").program(seq_len=48, kv_heads=2, causal=True)
  assert (prog.params["q_len"], prog.params["kv_len"], prog.params["kv_heads"], prog.params["causal"]) == (
      48, 48, 2, True)
  moe = jm.programs.find_operator("moe")
  assert moe.program(capacity_factor=1).routing.capacity == 128  # 512 tokens * top 2 / 8 experts
  with pytest.raises(jm.ProgramError, match=r"moe: top_k=0 must be at least 1 \(experts each token"):
    moe.program(top_k=0)
  with pytest.raises(jm.ProgramError, match="must be between 1 and experts=8"):
    moe.program(top_k=9)
  with pytest.raises(jm.ProgramError, match="no parameter \\['heads'\\]; its parameters are tokens, d_model"):
    moe.program(heads=2)
  with pytest.raises(jm.ProgramError, match="dtype='float64' must be one of float32, bfloat16, float16"):
    moe.program(dtype="float64")
  with pytest.raises(jm.ProgramError, match="m=2.5 must be an integer"):
    jm.programs.find_operator("matmul").program(m=2.5)
  with pytest.raises(jm.UnknownNameError, match="unknown operator 'conv'; the operators are attention, matmul"):
    jm.programs.find_operator("conv")
  with pytest.raises(jm.ProgramError, match="default 0 must be at least 1"):
    jm.programs.Param(name="n", default=0, minimum=1, help="n")
  with pytest.raises(jm.ProgramError, match="needs its kind"):
    jm.programs.Param(name="n", default=None, help="n")
  with pytest.raises(jm.ProgramError, match="declares parameters \\['n'\\] twice"):
    n = jm.programs.Param(name="n", default=1, help="n")
    jm.programs.Operator(name="op", summary="", params=(n, n), build=dict)
