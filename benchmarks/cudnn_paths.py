"""The plain attention jaxmercury hands back against the cuDNN call paths, side by side on one GPU.

    python -m benchmarks.cudnn_paths

Times, in 200 interleaved rounds (``tuner.measure.rounds``), GQA B1 H32 KV8 D128 bf16 at S16K, causal and not:
``jax.nn.dot_product_attention(implementation="cudnn")`` as a user writes it, the same as jaxmercury's plain
program (``tuner.plain``: what a tune returns when no schedule beats it), and JAX's cuDNN call with and without
its softmax statistics (``return_residual``, the training forward the benchmarks' baselines run). It prints the
medians and the custom calls, copies and transposes of each compiled program.
"""

import math
import statistics

import jax
import jax.numpy as jnp

import jaxmercury as jm
from jaxmercury._compat import MaskType, cudnn_attention  # the raw cuDNN call the baselines make
from jaxmercury.tuner import measure
from jaxmercury.tuner.plain import plain_programs


def _cudnn(causal: bool, residual: bool):
  mask = MaskType.CAUSAL if causal else MaskType.NO_MASK

  def call(q, k, v):
    out = cudnn_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]), mask_type=mask,
                                      qkv_layout="BTNH", return_residual=residual)
    return out[0] if residual else out
  return jax.jit(call)


def main():
  mesh = jax.make_mesh((1,), ("gpu",))
  for causal in (True, False):
    prog = jm.programs.attention(1, 32, 8, 16384, 16384, 128, causal=causal, dtype=jnp.bfloat16)
    q, k, v = prog.random_inputs(jax.random.key(0))
    plain = next(p for p in plain_programs(prog, mesh) if "cuDNN" in p.name)
    user = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    calls = {"jax.nn cudnn": jax.jit(user), "jm plain": plain.compile(),
             "cudnn residual": _cudnn(causal, True), "cudnn no residual": _cudnn(causal, False)}
    ready = {name: (lambda f=f: f(q, k, v)) for name, f in calls.items()}
    for run in ready.values():
      jax.block_until_ready(run())
    times = measure.rounds(ready, 200)
    print("causal" if causal else "full", {name: round(statistics.median(t), 3) for name, t in times.items()})
    for name, f in calls.items():
      text = f.lower(q, k, v).compile().as_text()
      targets = [line.split("custom_call_target=")[1].split(",")[0] for line in text.splitlines()
                 if "custom_call_target" in line]
      print("  ", name, "custom calls:", targets[:4], "copies:", text.count(" copy("),
            "transposes:", text.count("transpose("))


if __name__ == "__main__":
  main()
