"""Local attention kernels on one GPU against cuDNN's ``jax.nn.dot_product_attention``.

Every registered local kernel that implements the attention pattern and runs on the device (``--configs``: every
configuration of each, ``registry.variants``) computes one device's whole attention as a one-device schedule patched
with it (``Schedule.patch``: one kernel call on the whole block), side by side with
``jax.nn.dot_product_attention(implementation="cudnn")`` on the same inputs; outputs are checked against cuDNN's
and TFLOP/s count a causal mask's visible half. ``--training`` times training steps instead: each kernel's
forward and the backward jaxmercury runs for it, against ``jax.vjp`` of cuDNN's attention (the backward counted
as 2.5 forwards). Each case records the registry's default kernel for its shape (``registry.default_kernel``).
``--smoke`` runs the kernels that have a Pallas interpret mode on the CPU, against XLA's attention.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

import jaxmercury as jm
from benchmarks import cases, harness, operators
from jaxmercury.kernels import registry
from jaxmercury.tuner import measure

XLA_MAX_SEQ = 8192  # XLA's attention holds the S x S scores: not timed above this


def plan(args) -> list:
  return cases.smoke_plan("kernels") if args.smoke else cases.plan(cases.options(args))


class Env:
  def __init__(self, args, results: dict, deadline: float):
    self.args, self.results, self.deadline = args, results, deadline
    self.mesh = harness.make_mesh("1")


def run_case(env, case) -> dict:
  """Every applicable kernel (configuration) against ``dot_product_attention`` on one device."""
  args, prog, mesh = env.args, operators.program(case), env.mesh
  impl = "xla" if args.smoke else "cudnn"
  inputs = list(prog.random_inputs(operators.case_key(args.seed, case.name)))
  attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation=impl)
  wrap = measure.training_step if args.training else jax.jit
  if args.training:  # the output's cotangent
    inputs.append(jax.random.normal(operators.case_key(args.seed + 1, case.name), prog.writes.shape,
                                    prog.writes.dtype))
  with registry.interpret_mode() if args.smoke else contextlib.nullcontext():
    names = registry.variants(prog, mesh) if args.configs else \
        [registry.KernelChoice(n) for n in registry.candidates(prog, mesh)]
    contestants = [harness.Contestant("dot_product_attention", "baseline", lambda: wrap(attend),
                                      f'jax.nn.dot_product_attention(implementation="{impl}")')]
    for choice in names:
      schedule = jm.Schedule(prog, mesh).patch(choice)
      big = choice.name == "xla" and case.seq > XLA_MAX_SEQ
      contestants.append(harness.Contestant(
          str(choice), "jaxmercury", lambda s=schedule: wrap(s.compile(differentiable=args.training)),
          registry.local(choice.name).description, skip=f"XLA holds the {case.seq}^2 scores" if big else None,
          record=operators.fields(schedule)))
    settings = harness.Settings.from_args(
      args, env.deadline, measure.gradient_tolerance(case.dtype) if args.training else harness.BF16_TOLERANCE)
    records, ref = harness.run_contestants(contestants, inputs, settings)
  rec = {"name": case.name, "op": case.op, "config": dataclasses.asdict(case), "training": args.training,
         "group": "training" if args.training else "forward", "default_kernel": registry.default_kernel(prog, mesh)}
  return harness.finish(rec, records, ref, flops_per_device=prog.flops * (3.5 if args.training else 1.0))
