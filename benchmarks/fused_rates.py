"""The fused ring attentions' kernel rates on one GPU, for the cost model's predictions (``predict_meshes``).

  python -m benchmarks.fused_rates --out rates.json

For each attention operator of ``benchmarks.predict_meshes.programs()``,
``calibrate.fused_rates`` times each fused ring attention on one device (a
ring of one: the local attention) and, beside it, ``calibrate.kernel_rates``
the local cuDNN kernel, so the two can be compared. Rates are executed flops
per second (a causal kernel computes about half the scores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
from jax.sharding import AxisType

from benchmarks.predict_meshes import programs
from jaxmercury.tuner import calibrate


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  rates = {}
  for label, prog in programs().items():
    if prog.pattern != "attention":
      continue
    fused = calibrate.fused_rates(prog, mesh)
    local, _ = calibrate.kernel_rates(prog, mesh, ["cudnn_attention"])
    rates[label] = {"fused": fused, "local": local}
    print(label, {k: f"{v / 1e12:.0f} TFLOP/s" for k, v in {**fused, **local}.items()}, flush=True)
  out = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "command": "python -m benchmarks.fused_rates " + " ".join(sys.argv[1:] if argv is None else argv),
         "rates": rates}
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
