"""Mixture of experts on one GPU (issue 31): the MoE layer against a plain-JAX einsum-dispatch MoE; grouped GEMMs.

Cases, at Mixtral-8x7B layer sizes (d_model 4096, d_ff 14336, 8 experts, top-2, 8K tokens, bf16):

* ``layer``: ``programs.moe`` as jaxmercury runs it, ``expert_parallel`` (and ``_pipelined``, and
  ``_ragged``: ``ragged_all_to_all``) on a one-device mesh (the routed
  exchange is then local: route, slot buffers, ``ragged_dot`` grouped GEMM, combine) with its ``ragged_dot``
  and its dense grouped GEMM, against ``models.mixtral.einsum_moe`` (the capacity-based einsum dispatch of Flax's
  and MaxText's MoE layers: one-hot ``[tokens, experts, capacity]`` dispatch and combine tensors), at capacity
  factor 1.25 and dropless (the einsum dispatch then gives every expert ``tokens`` slots). The dense
  reference (every expert on every token, masked) checks both and is not timed. TFLOP/s count the routed work.
  ``--training`` times forward and backward.
* ``grouped_gemm``: the two grouped GEMM shapes of the routed rows (``[tokens * top_k, d] @ [experts, d, f]``, the
  gate / up projection, and ``[tokens * top_k, f] @ [experts, f, d]``, the down projection), rows sorted by
  expert, group sizes from a top-2 routing of random tokens: ``jax.lax.ragged_dot`` and the Pallas Mosaic GPU
  grouped GEMM (``kernels.moe.grouped_gemm``, what ``dispatch(gemm="mosaic_grouped_gemm")`` runs), side by
  side, against the capacity-padded batched einsum (rows scattered into ``[experts, largest group, d]``); forward
  and forward + backward (``dx`` and ``dw``), every output checked against the einsum. Each record has its
  TFLOP/s and ``ratio_to_ragged_dot`` (ragged_dot's time over its own: above 1, faster than ragged_dot). The
  Mosaic kernel needs a Hopper GPU: elsewhere it is skipped with the reason.

``--smoke`` runs one tiny case of each kind on the simulated CPU mesh (the layer on 8 devices, experts spread, at
capacity factor 1.25; the down projection's grouped GEMMs forward + backward), the dispatched schedules also with
their dense grouped GEMM (every local expert on every slot: not timed on GPUs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmercury as jm
from benchmarks import harness, operators
from jaxmercury.kernels.moe import grouped_gemm as mgg
from jaxmercury.tuner import measure
from models.mixtral import einsum_moe


@dataclasses.dataclass(frozen=True)
class MoECase:
  """One case: ``kind`` ``"layer"`` or ``"grouped_gemm"``; sizes; ``mesh`` as ``harness.make_mesh`` reads it."""

  kind: str
  tokens: int
  d_model: int
  d_ff: int
  experts: int
  top_k: int
  capacity_factor: float | None
  mesh: str = "1"
  dtype: str = "bfloat16"
  op: str = "moe"
  projection: str = "gate"  # grouped_gemm: "gate" ([rows, d] @ [e, d, f]) or "down" ([rows, f] @ [e, f, d])
  backward: bool = False  # grouped_gemm: forward and backward (dx, dw) in one step

  @property
  def name(self) -> str:
    cap = "dropless" if self.capacity_factor is None else f"cf{self.capacity_factor}"
    gemm = f" {self.projection}{' fwd+bwd' if self.backward else ''}" if self.kind == "grouped_gemm" else ""
    return (f"moe.{self.kind}{gemm} t{self.tokens} d{self.d_model} f{self.d_ff} e{self.experts} k{self.top_k} {cap} "
            f"mesh{self.mesh}")

  @property
  def flops(self) -> float:
    routed = 2.0 * self.tokens * self.top_k * self.d_model * self.d_ff
    if self.kind == "grouped_gemm":
      return routed * (3.0 if self.backward else 1.0)
    return 3 * routed + 2.0 * self.tokens * self.d_model * self.experts


MIXTRAL = dict(tokens=8192, d_model=4096, d_ff=14336, experts=8, top_k=2)


def _grouped_cases(sizes: dict) -> list:
  return [MoECase("grouped_gemm", capacity_factor=None, projection=p, backward=b, **sizes)
          for p in ("gate", "down") for b in (False, True)]


def plan(args) -> list:
  kinds = getattr(args, "moe_kinds", None) or ("grouped_gemm", "layer")
  if args.smoke:
    tiny = dict(tokens=256, d_model=128, d_ff=256, experts=8, top_k=2)
    out = [MoECase("layer", capacity_factor=1.25, mesh="8", **tiny),
           MoECase("grouped_gemm", capacity_factor=None, projection="down", backward=True, **tiny)]
  else:
    out = _grouped_cases(MIXTRAL) + [MoECase("layer", capacity_factor=1.25, **MIXTRAL),
                                     MoECase("layer", capacity_factor=None, **MIXTRAL)]
  return [c for c in out if c.kind in kinds]


class Env:
  def __init__(self, args, results: dict, deadline: float):
    self.args, self.results, self.deadline = args, results, deadline


def run_case(env, case: MoECase) -> dict:
  return (_layer if case.kind == "layer" else _grouped_gemm)(env, case)


def _inputs(case: MoECase, seed: int, mesh):
  """The layer's five inputs, weights scaled by their fan-in (activations stay O(1) in bf16), replicated."""
  t, d, f, e = case.tokens, case.d_model, case.d_ff, case.experts
  keys = jax.random.split(operators.case_key(seed, case.name), 5)
  whole = NamedSharding(mesh, P())
  shapes = [((t, d), 1.0), ((d, e), d ** -0.5), ((e, d, f), d ** -0.5), ((e, d, f), d ** -0.5), ((e, f, d), f ** -0.5)]
  return [jax.jit(lambda k, s=s, c=c: (c * jax.random.normal(k, s, jnp.float32)).astype(case.dtype),
                  out_shardings=whole)(key) for key, (s, c) in zip(keys, shapes)]


def _layer(env, case: MoECase) -> dict:
  args = env.args
  mesh = harness.make_mesh(case.mesh)
  prog = jm.programs.moe(case.tokens, case.d_model, case.d_ff, case.experts, case.top_k,
                         capacity_factor=case.capacity_factor, dtype=case.dtype)
  inputs = _inputs(case, args.seed, mesh)
  if args.training:
    inputs.append(jax.random.normal(operators.case_key(args.seed + 1, case.name), prog.writes.shape,
                                    jnp.float32).astype(case.dtype))
  wrap = measure.training_step if args.training else jax.jit
  plain = lambda *a: einsum_moe(*a, top_k=case.top_k, capacity_factor=case.capacity_factor)
  lib = jm.library(prog, mesh)
  contestants = [harness.Contestant("dense_reference", "reference", lambda: wrap(prog.reference),
                                    "every expert on every token, masked (programs.moe's reference)")]
  contestants.append(harness.Contestant(
      "einsum_dispatch", "baseline", lambda: wrap(plain),
      "plain JAX: one-hot [tokens, experts, capacity] dispatch and combine einsums (Flax / MaxText style)"))
  for name in ("expert_parallel", "expert_parallel_pipelined", "expert_parallel_ragged"):
    if name not in lib:
      continue
    # dense: every expert on every slot; the Mosaic grouped GEMM where the devices have it (Hopper)
    for gemm in ("ragged_dot", "dense") if args.smoke else ("ragged_dot", "mosaic_grouped_gemm"):
      if gemm == "dense" and name != "expert_parallel":
        continue
      label, record = f"jaxmercury {name}, grouped GEMM {gemm}", {"strategy": name, "gemm": gemm}
      try:
        schedule = lib[name].without("dispatch").dispatch(lib[name].dispatched["loop"], gemm=gemm,
                                                          exchange=lib[name].dispatched["exchange"])
      except jm.ScheduleError as e:
        contestants.append(harness.Contestant(f"{name}[{gemm}]", "jaxmercury", None, label, skip=str(e),
                                              record=record))
        continue
      contestants.append(harness.Contestant(f"{name}[{gemm}]", "jaxmercury", lambda s=schedule: wrap(s.compile()),
                                            label, record=record))
  settings = harness.Settings.from_args(
      args, env.deadline, measure.gradient_tolerance(case.dtype) if args.training else harness.BF16_TOLERANCE)
  records, ref = harness.run_contestants(contestants, inputs, settings)
  rec = {"name": case.name, "op": case.op, "config": dataclasses.asdict(case), "training": args.training,
         "group": "training" if args.training else "forward"}
  devices = np.prod(list(mesh.shape.values()))
  return harness.finish(rec, records, ref, flops_per_device=case.flops * (3.0 if args.training else 1.0) / devices)


def _grouped_gemm(env, case: MoECase) -> dict:
  """``ragged_dot`` and the Mosaic grouped GEMM side by side, against the capacity-padded batched einsum, on rows
  grouped by a top-2 routing; ``case.backward``: each as one forward + backward step (``dx``, ``dw``)."""
  args = env.args
  mesh = harness.make_mesh("1")
  x, router, w_gate, _, w_down = _inputs(case, args.seed, mesh)
  _, picked = jax.lax.top_k(jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32)), case.top_k)
  experts = np.sort(np.asarray(picked).ravel())
  sizes = np.bincount(experts, minlength=case.experts).astype(np.int32)
  rows = jnp.repeat(x, case.top_k, axis=0)  # [tokens * top_k, d], taken as sorted by expert
  w = w_gate
  if case.projection == "down":  # the down projection's rows: [tokens * top_k, f], hidden activations
    rows = jax.random.normal(operators.case_key(args.seed + 2, case.name), (rows.shape[0], case.d_ff),
                             jnp.float32).astype(case.dtype)
    w = w_down
  largest = int(sizes.max())
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  slot = np.arange(len(experts)) - starts[experts]  # each row's place in its group
  group_sizes = jnp.asarray(sizes)

  def ragged(rows, w):
    return jax.lax.ragged_dot(rows, w, group_sizes, preferred_element_type=jnp.float32).astype(rows.dtype)

  def mosaic(rows, w):
    return mgg.grouped_gemm(rows, w, group_sizes, out_dtype=rows.dtype)

  def padded(rows, w):
    grouped = jnp.zeros((case.experts, largest, rows.shape[1]), rows.dtype).at[experts, slot].set(rows)
    out = jnp.einsum("ecd,edf->ecf", grouped, w, preferred_element_type=jnp.float32).astype(rows.dtype)
    return out[experts, slot]

  inputs = [rows, w]
  wrap = jax.jit
  if case.backward:
    inputs.append(jax.random.normal(operators.case_key(args.seed + 1, case.name), (rows.shape[0], w.shape[2]),
                                    jnp.float32).astype(case.dtype))
    wrap = measure.training_step
  config = mgg.MOSAIC_GROUPED_GEMM.configure()
  why_not = mgg.devices_problem(mesh) or mgg.problem(rows.shape[1], w.shape[2], rows.dtype, config)
  contestants = [harness.Contestant("padded_einsum", "baseline", lambda: wrap(padded),
                                    f"rows scattered into [experts, {largest}, d], one batched einsum"),
                 harness.Contestant("ragged_dot", "jaxmercury", lambda: wrap(ragged),
                                    "jax.lax.ragged_dot (dispatch(gemm='ragged_dot'))", record={"gemm": "ragged_dot"}),
                 harness.Contestant("mosaic_grouped_gemm", "jaxmercury", lambda: wrap(mosaic),
                                    "Pallas Mosaic GPU grouped GEMM (dispatch(gemm='mosaic_grouped_gemm'))",
                                    skip=why_not, record={"gemm": "mosaic_grouped_gemm",
                                                          "config": dataclasses.asdict(config)})]
  tolerance = measure.gradient_tolerance(case.dtype) if case.backward else harness.BF16_TOLERANCE
  settings = harness.Settings.from_args(args, env.deadline, tolerance)
  records, ref = harness.run_contestants(contestants, inputs, settings)
  rec = {"name": case.name, "op": case.op, "config": dataclasses.asdict(case), "training": case.backward,
         "group": "training" if case.backward else "forward", "largest_group": largest,
         "group_sizes": sizes.tolist()}
  out = harness.finish(rec, records, ref, flops_per_device=case.flops)
  by_name = {r["name"]: r for r in out["contestants"]}
  if "median_ms" in by_name["ragged_dot"]:
    for r in out["contestants"]:
      if "median_ms" in r:
        r["ratio_to_ragged_dot"] = by_name["ragged_dot"]["median_ms"] / r["median_ms"]
    kernel = by_name["mosaic_grouped_gemm"]
    if "median_ms" in kernel:
      harness.log(f"  side by side: mosaic_grouped_gemm {kernel['median_ms']:.3f} ms "
                  f"({kernel['tflops_per_device']:.1f} TFLOP/s), ragged_dot {by_name['ragged_dot']['median_ms']:.3f} "
                  f"ms ({by_name['ragged_dot']['tflops_per_device']:.1f} TFLOP/s): the kernel is "
                  f"{kernel['ratio_to_ragged_dot']:.2f}x ragged_dot's speed")
  return out
