"""Loop-nest patterns: patch matches a user's program up to axis names, and checks its body."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import pytest
from conftest import fresh_key, make_mesh, rel_err

import jaxmercury as jm
from jaxmercury.kernels import patterns, registry
from jaxmercury.programs.attention import attention_block


@pytest.fixture
def kernels(monkeypatch):
  """A private registry with test kernels written for the patterns' own axis names."""
  monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))

  def make_attention(program, config, interpret):
    assert config.block in (4, 8)
    return functools.partial(attention_block, causal=program.params["causal"])

  registry.register(registry.Kernel(name="test_attention", patterns=frozenset({"attention"}), make=make_attention,
                                    config=Blocks))
  registry.register(registry.Kernel(
      name="test_matmul", patterns=frozenset({"matmul"}),
      make=lambda program, config, interpret: lambda ctx, a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)))
  registry.register(registry.Kernel(name="test_hopper_only", patterns=frozenset({"matmul"}),
                                    make=registry.kernel("test_matmul").make,
                                    supports=lambda device: f"needs a Hopper GPU, device is {device.device_kind}"))
  registry.register(registry.Kernel(name="test_interpreted", patterns=frozenset({"matmul"}),
                                    make=lambda program, config, interpret: _interpreted_matmul(interpret),
                                    platforms=frozenset({"gpu"}), interpret=True))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blocks:
  block: int = jm.kernels.param(4, 8)


def _interpreted_matmul(interpret):
  assert interpret, "made for a CPU only in interpret mode"
  return lambda ctx, a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)


def _user_attention(causal, scale=None):
  """Attention declared by a user with axis names of their own and their own body."""
  batch, heads, groups = jm.Axis("batch", 1), jm.Axis("kvh", 2), jm.Axis("grp", 2)
  tq, tk, dim = jm.Axis("tq", 64), jm.Axis("tk", 64), jm.Axis("dim", 16)

  def body(ctx, q, k, v):
    s = jnp.einsum("nqhgd,nkhd->nhgqk", q, k, preferred_element_type=jnp.float32)
    s = s * (scale or 1 / math.sqrt(q.shape[-1]))
    keep = ctx.valid("tk")[None, :]
    if causal:
      keep = keep & (ctx.positions("tq")[:, None] >= ctx.positions("tk")[None, :])
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = jnp.sum(p, -1)
    o = jnp.einsum("nhgqk,nkhd->nqhgd", p, v.astype(jnp.float32))
    o = o / jnp.transpose(jnp.where(total == 0, 1.0, total), (0, 3, 1, 2))[..., None]
    return o, jnp.transpose(m[..., 0] + jnp.log(total), (0, 3, 1, 2))

  q = jm.match_buffer("query", (batch, tq, (heads, groups), dim), jnp.float32)
  k = jm.match_buffer("key", (batch, tk, heads, dim), jnp.float32)
  v = jm.match_buffer("value", (batch, tk, heads, dim), jnp.float32)
  o = jm.match_buffer("out", (batch, tq, (heads, groups), dim), jnp.float32)
  return jm.grid((batch, heads, groups, tq, tk), "ssssr", reads=(q, k, v), writes=o, body=body,
                 reduction=jm.LogSumExp(value_axes=("dim",)), name="my attention")


def _user_matmul(body=None):
  x, y, z = jm.Axis("rows", 64), jm.Axis("cols", 32), jm.Axis("inner", 48)
  a = jm.match_buffer("X", (x, z), jnp.float32)
  b = jm.match_buffer("W", (z, y), jnp.float32)
  c = jm.match_buffer("Y", (x, y), jnp.float32)
  return jm.grid((x, y, z), "ssr", reads=(a, b), writes=c, reduction=jm.Sum(), name="my gemm",
                 body=body or (lambda ctx, a, b: a @ b))


@pytest.mark.parametrize("causal", [False, True])
def test_user_attention_matches_with_its_own_axis_names(kernels, causal):
  prog = _user_attention(causal)
  m = patterns.match("attention", prog)
  assert m.params == {"causal": causal, "emit_lse": False}
  assert m.to_pattern == {"batch": "b", "tq": "i", "kvh": "hk", "grp": "g", "dim": "d", "tk": "j"}
  s = jm.Schedule(prog, make_mesh("8")).tile("tq", 8).parallelize("tq0", "x").tile("tk", 8).shift("tk0", "tq0")
  s.patch("test_attention", block=8)
  assert s.kernel == "test_attention" and "[kernel test_attention(block=8)]" in str(s)
  xs = prog.random_inputs(fresh_key())
  assert rel_err(s.compile()(*xs), prog.reference(*xs)) < 2e-5


def test_body_that_computes_something_else_is_refused(kernels):
  prog = _user_attention(False, scale=1.0)  # unscaled scores: not the pattern's attention
  with pytest.raises(jm.PreconditionError, match="body computes something else than the pattern's"):
    jm.Schedule(prog, make_mesh("8")).patch("test_attention")
  doubled = _user_matmul(lambda ctx, a, b: 2 * (a @ b))
  with pytest.raises(jm.PreconditionError, match="my gemm does not match loop-nest pattern 'matmul'"):
    jm.Schedule(doubled, make_mesh("8")).patch("test_matmul")


def test_structure_mismatch_names_the_buffer_or_loop(kernels):
  with pytest.raises(jm.PreconditionError, match="reads 2 buffers, the pattern reads 3"):
    patterns.match("attention", _user_matmul())
  x, y, z = jm.Axis("x", 8), jm.Axis("y", 8), jm.Axis("z", 8)
  transposed = jm.grid((x, y, z), "ssr", reads=(jm.match_buffer("A", (z, x), jnp.float32),
                                                jm.match_buffer("B", (z, y), jnp.float32)),
                       writes=jm.match_buffer("C", (x, y), jnp.float32), reduction=jm.Sum(),
                       body=lambda ctx, a, b: a.T @ b)
  with pytest.raises(jm.PreconditionError, match="plays two roles of the pattern"):
    patterns.match("matmul", transposed)


def test_user_matmul_schedule_with_renamed_kernel(kernels):
  prog = _user_matmul()
  s = jm.Schedule(prog, make_mesh("8")).tile("rows", 8).parallelize("rows0", "x").patch("test_matmul")
  xs = prog.random_inputs(fresh_key())
  assert rel_err(s.compile()(*xs), prog.reference(*xs)) < 2e-5
  trace = s.to_json()
  assert jm.Schedule.from_json(prog, make_mesh("8"), trace).kernel == "test_matmul"


def test_variants_names_and_bad_parameters(kernels):
  k = registry.kernel("test_attention")
  assert [str(v) for v in k.variants()] == ["test_attention", "test_attention(block=8)"]
  prog = jm.programs.attention(1, 2, 2, 16, 16, 8)
  eight = registry.KernelChoice("test_attention", Blocks(block=8))
  assert eight in registry.variants(prog, make_mesh("8"))
  assert jm.Schedule(prog, make_mesh("8")).kernel_variants() == registry.variants(prog, make_mesh("8"))
  assert "test_attention" in registry.candidates(prog, make_mesh("8"))
  assert jm.Schedule(prog, make_mesh("8")).kernel_candidates() == registry.candidates(prog, make_mesh("8"))
  s = jm.Schedule(prog, make_mesh("8"))
  with pytest.raises(jm.PreconditionError, match=r"block=16 is not one of the choices \[4, 8\]"):
    s.patch("test_attention", block=16)
  with pytest.raises(jm.UnknownNameError, match="no parameter 'tile'"):
    s.patch("test_attention", tile=4)
  assert s.kernel is None  # a refused patch leaves the schedule as it was
  s.patch("test_attention", block=4)
  assert s.kernel == "test_attention" and s.kernel_config == Blocks()
  assert s.trace[-1] == {"primitive": "patch", "args": ["test_attention"], "kwargs": {}}  # the default: no kwargs
  s.patch(eight)
  assert s.kernel_config == Blocks(block=8) and s.trace[-1]["kwargs"] == {"block": 8}


def test_device_requirements_and_interpret_mode(kernels):
  prog = jm.programs.matmul(64, 32, 48)
  mesh = make_mesh("8")
  with pytest.raises(jm.PreconditionError, match="needs a Hopper GPU, device is cpu"):
    jm.Schedule(prog, mesh).patch("test_hopper_only")
  with pytest.raises(jm.PreconditionError, match=r"runs on \['gpu'\].*interpret mode"):
    jm.Schedule(prog, mesh).patch("test_interpreted")
  assert "test_interpreted" not in registry.candidates(prog, mesh)
  with registry.interpret_mode():
    assert "test_interpreted" in registry.candidates(prog, mesh)
    s = jm.Schedule(prog, mesh).tile("m", 8).parallelize("m0", "x").patch("test_interpreted")
    xs = prog.random_inputs(fresh_key())
    assert rel_err(s.compile()(*xs), prog.reference(*xs)) < 2e-5
  # Planning on an abstract mesh does not check devices.
  abstract = jax.sharding.AbstractMesh((8,), ("x",))
  jm.Schedule(prog, abstract).patch("test_hopper_only")


def test_shipped_programs_match_their_patterns():
  att = jm.programs.attention(1, 4, 2, 32, 32, 8, causal=True)
  assert patterns.match("attention", att).params == {"causal": True, "emit_lse": False}
  from jaxmercury.programs import attention_backward as backward
  assert patterns.match("attention", backward.attention_with_lse(att)).params["emit_lse"]
  assert patterns.match("attention_dq", backward.attention_dq(att)).params == {"causal": True}
  assert patterns.match("attention_dkv", backward.attention_dkv(att)).to_pattern["j"] == "j"
  with pytest.raises(jm.PreconditionError):
    patterns.match("attention_dq", backward.attention_dkv(att))


def test_pattern_known_only_by_name(kernels):
  registry.register(registry.Kernel(name="test_gated", patterns=frozenset({"gated"}),
                                    make=lambda program, config, interpret: program.body))
  prog = jm.programs.matmul(16, 16, 16)
  with pytest.raises(jm.PreconditionError, match="declares pattern 'matmul', not 'gated'"):
    jm.Schedule(prog, make_mesh("8")).patch("test_gated")
  gated = _user_matmul()
  gated = jm.grid(gated.loops, "ssr", reads=gated.reads, writes=gated.writes, body=gated.body,
                  reduction=jm.Sum(), pattern="gated")
  jm.Schedule(gated, make_mesh("8")).patch("test_gated")
