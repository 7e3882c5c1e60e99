"""One attention case for a profiler: cuDNN's kernels and ours (backward by default, or forward), run apart.

    ncu -k regex:'attention_backward_ws|bprop' --section WarpStateStats ... \\
        python3 -m benchmarks.ws_profile --seq 16K --kv 32 [--causal] [--variants ws_default ws_serial]

Each contestant runs ``--reps`` times after one warm-up call, so that a profiler filtering by kernel name
(``--launch-skip``/``--launch-count``) sees compiled, warm launches. The inputs are ``benchmarks.ws_local``'s
(B1 H32 D128 bf16, the forward's output and log-sum-exp from our forward kernel); our gradients are checked against
cuDNN's before the profiled calls, so a profile is never of a kernel that computes something else.

``--forward`` runs the forward instead: cuDNN's (``jax.nn.dot_product_attention(implementation="cudnn")``) and
the kernel (``kernels.attention.ws_forward``) at each of ``--steps`` (``ws_local.STEPS``), outputs checked against
cuDNN's first: for counters such as DRAM bytes and L2 hit rates of the two forwards on the same inputs.

``--training --step NAME`` runs one training step of ``benchmarks.ws_local --training`` instead (``cudnn``: the
vjp of cuDNN's attention; ``ws``, ``ws_own``: the fused ring attention's schedule with cuDNN's backward or ours;
``cudnn_blocks``: the schedule on cuDNN blocks), a warm-up call and ``--reps`` more, on inputs made on the host,
so that every kernel the process launches belongs to a call of that step (``benchmarks.ncu_kernels`` divides by
the calls). Nothing else runs to check it: the same step at the same commit is checked against cuDNN's by
``ws_local --training``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from benchmarks import harness, ws_local
from jaxmercury.tuner import measure


def host_inputs(s: int, h: int, kv: int, d: int, seed: int) -> list:
  """Fresh bf16 ``q, k, v`` and a cotangent (``ws_local --training``'s shapes), made on the host: no kernel."""
  rng = np.random.default_rng(seed)
  host = lambda *shape: rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
  return [jax.device_put(x) for x in (host(1, s, h, d), host(1, s, kv, d), host(1, s, kv, d), host(1, s, h, d))]


def training_step(name: str, s: int, h: int, kv: int, d: int, causal: bool, smoke: bool):
  """``ws_local.training_step`` ``name`` at batch 1 on a one-device mesh."""
  return ws_local.training_step(name, ws_local.one_device_mesh(), 1, s, h, kv, d, causal, smoke)


GRADIENT_TOLERANCE = measure.gradient_tolerance(jnp.bfloat16)


def backward_case(s: int, h: int, kv: int, d: int, causal: bool, smoke: bool, variants: dict) -> tuple[list, dict]:
  """``(inputs, {name: backward})``: ``ws_local``'s backward inputs and, jitted, cuDNN's backward (``cudnn``) and
  ours at each of ``variants`` (``{name: BackwardBlocks}``), each called once and its gradients checked against
  cuDNN's (so that a warm, compiled contestant is never one that computes something else)."""
  keys = jax.random.split(jax.random.key(s + 7 * kv + causal), 4)
  inputs = ws_local.backward_inputs(ws_local.random_qkv(keys, 1, s, h, kv, d), keys[3], causal, smoke)
  contestants = {"cudnn": ws_local.cudnn_backward_of(causal, smoke)}
  contestants |= {name: ws_local.ws_backward_of(causal, smoke, blocks) for name, blocks in variants.items()}
  reference = jax.block_until_ready(contestants["cudnn"](*inputs))
  for name, fn in contestants.items():
    grads = jax.block_until_ready(fn(*inputs))
    for label, got, want in zip(("dq", "dk", "dv"), grads, reference):
      if not (err := harness.rel_err(got, want)) <= GRADIENT_TOLERANCE:
        raise SystemExit(f"{name}: {label} differs from cuDNN's by {err:.3g} (relative Frobenius, over "
                         f"{GRADIENT_TOLERANCE})")
  return inputs, contestants


def forward_case(s: int, h: int, kv: int, d: int, causal: bool, smoke: bool, steps: list) -> tuple[list, dict]:
  """``(inputs, {name: forward})``: ``ws_local``'s forward inputs and, jitted, cuDNN's forward (``cudnn``) and the
  kernel at each of ``steps`` (``ws_local.STEPS`` names), each called once and its output checked against cuDNN's."""
  keys = jax.random.split(jax.random.key(s + 7 * kv + causal), 4)
  inputs = ws_local.random_qkv(keys, 1, s, h, kv, d)
  mesh = ws_local.one_device_mesh()
  contestants = {"cudnn": jax.jit(ws_local.cudnn_forward(causal, smoke))}
  contestants |= {name: ws_local.kernel_forward(mesh, causal, smoke, **ws_local.STEPS[name]) for name in steps}
  reference = jax.block_until_ready(contestants["cudnn"](*inputs))
  for name, fn in contestants.items():
    if not (err := harness.rel_err(jax.block_until_ready(fn(*inputs)), reference)) <= harness.BF16_TOLERANCE:
      raise SystemExit(f"{name}: the output differs from cuDNN's by {err:.3g} (relative Frobenius, over "
                       f"{harness.BF16_TOLERANCE})")
  return inputs, contestants


def training(args, s: int, h: int, d: int) -> None:
  """``args.step``'s training step, a warm-up call and ``args.reps`` more, on inputs made on the host."""
  inputs = host_inputs(s, h, args.kv, d, s + 7 * args.kv + args.causal)
  step = training_step(args.step, s, h, args.kv, d, args.causal, args.smoke)
  for _ in range(1 + args.reps):
    jax.block_until_ready(step(*inputs))
  print(f"{args.step}: {1 + args.reps} calls of the training step (the first a warm-up)", flush=True)


def case_arguments(parser, seq: str, kv: int) -> None:
  """A backward case's flags (``--seq``, ``--kv``, ``--causal``) and ``--variants``, our backward's contestants."""
  parser.add_argument("--seq", default=seq)
  parser.add_argument("--kv", type=int, default=kv)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--variants", nargs="+", default=["ws_default"], choices=list(ws_local.BACKWARD_STEPS))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  case_arguments(parser, "16K", 32)
  parser.add_argument("--reps", type=int, default=1)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--training", action="store_true", help="one training step, --step, alone in the process")
  parser.add_argument("--step", default="ws", choices=ws_local.TRAINING_STEPS)
  parser.add_argument("--forward", action="store_true", help="the forwards, cuDNN's and the kernel's at --steps")
  parser.add_argument("--steps", nargs="+", default=["default"], choices=list(ws_local.STEPS))
  parser.add_argument("--smoke", action="store_true", help="a small case on the CPU (XLA, interpret mode)")
  args = parser.parse_args(argv)
  s, h, d = ws_local.seq_length(args.seq), args.heads, args.head_dim
  if args.smoke:
    s, args.kv, h, d = 256, 2, 4, 64
    ws_local.smoke_flags()
  if args.training:
    return training(args, s, h, d)
  if args.forward:
    inputs, contestants = forward_case(s, h, args.kv, d, args.causal, args.smoke, args.steps)
    checked = f"output within {harness.BF16_TOLERANCE}"
  else:
    variants = {name: ws_local.BACKWARD_STEPS[name] for name in args.variants}
    inputs, contestants = backward_case(s, h, args.kv, d, args.causal, args.smoke, variants)
    checked = f"gradients within {GRADIENT_TOLERANCE}"
  for name, fn in contestants.items():
    for _ in range(args.reps):
      jax.block_until_ready(fn(*inputs))
    print(f"{name}: {args.reps} profiled calls, {checked} of cuDNN's (relative)", flush=True)


if __name__ == "__main__":
  main()
