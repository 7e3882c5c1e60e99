"""The operator cases every suite runs, and which cases each suite runs by default (no JAX here: planning comes
before JAX starts, so that XLA's windowed-einsum child process can have the devices first).

Attention after the Mercury evaluation (§8): MHA (32 query heads, 32 key/value heads) and GQA (32 / 8), head
dimension 128, batch 1 and 16, causal and not, sequences from 4K doubling to 1M, sequence-sharded over every mesh
level. GEMM: the tensor-parallel linear layers of Llama-3 8B and 70B at global M (tokens) 4K to 32K: the
column-parallel layers (fused QKV, fused gate+up) as all-gather GEMMs, the row-parallel ones (attention output,
down) as reduce-scatter GEMMs. ``--smoke`` plans tiny versions of the same for the simulated 8-device CPU mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

DTYPE = "bfloat16"
ATTENTION_HEADS = {"MHA": (32, 32), "GQA": (32, 8)}
# (hidden, intermediate, query heads, kv heads, head dim) of the Llama-3 models.
LLAMA3 = {"8B": (4096, 14336, 32, 8, 128), "70B": (8192, 28672, 64, 8, 128)}
LAYERS = ("qkv", "gate_up", "o", "down")


def doubling(lo: int, hi: int) -> tuple[int, ...]:
  """``lo, 2 lo, 4 lo, ...`` up to ``hi``."""
  out = [lo]
  while out[-1] * 2 <= hi:
    out.append(out[-1] * 2)
  return tuple(out)


K = 1024
# What each suite runs unless its flags say otherwise (attention and GEMM shapes over every device).
SUITE_DEFAULTS = {
    "attention": dict(ops=("attention",), seqs=doubling(4 * K, K * K), batches=(1, 16), variants=("MHA", "GQA"),
                      causal=(False, True)),
    "gemm": dict(ops=("gemm",), gemm_m=doubling(4 * K, 32 * K), models=("8B", "70B"), layers=LAYERS),
    "fused": dict(ops=("attention", "gemm"), seqs=(16 * K, 32 * K, 64 * K), batches=(1,), variants=("MHA", "GQA"),
                  causal=(False, True), gemm_m=(8 * K,), models=("8B", "70B"), layers=LAYERS),
    "training": dict(ops=("attention", "gemm"), seqs=(16 * K, 32 * K), batches=(1,), variants=("GQA",),
                     causal=(True,), gemm_m=(8 * K,), models=("8B",), layers=LAYERS),
    "kernels": dict(ops=("attention",), seqs=doubling(4 * K, 32 * K), batches=(1,), variants=("MHA", "GQA"),
                    causal=(False, True), mesh="1"),
    "tuner": dict(ops=("attention", "gemm"), seqs=(32 * K,), batches=(1,), variants=("GQA",), causal=(False,),
                  gemm_m=(8 * K,), models=("8B",), layers=("gate_up", "down")),
}


@dataclasses.dataclass(frozen=True)
class AttentionCase:
  """Attention ``[batch, seq, heads, head_dim]`` over ``mesh`` (``""``: one level of every device, ``"8"``: one
  level of 8, ``"2x4"``: levels ``node`` x ``gpu``)."""

  batch: int
  heads: int
  kv_heads: int
  head_dim: int
  seq: int
  causal: bool
  mesh: str = ""
  dtype: str = DTYPE
  op: str = "attention"

  @property
  def variant(self) -> str:
    return "MHA" if self.heads == self.kv_heads else ("MQA" if self.kv_heads == 1 else "GQA")

  @property
  def family(self) -> str:
    """The case without its size: the sweep it belongs to."""
    return self.name.replace(f" S{size_label(self.seq)} ", " ")

  @property
  def name(self) -> str:
    return (f"attention {self.variant} B{self.batch} S{size_label(self.seq)} H{self.heads} KV{self.kv_heads} "
            f"D{self.head_dim}{' causal' if self.causal else ''}{_on(self.mesh)}")

  @property
  def flops(self) -> float:
    """Attention's matrix flops (a causal mask's visible half)."""
    return 4.0 * self.batch * self.heads * self.seq ** 2 * self.head_dim * (0.5 if self.causal else 1.0)


@dataclasses.dataclass(frozen=True)
class GemmCase:
  """``[m, k] @ [k, n]`` over ``mesh``: an all-gather GEMM (``kind="allgather"``: x row-sharded, w and the output
  column-sharded) or a reduce-scatter GEMM (``"reducescatter"``: x column-sharded, w and the output row-sharded)."""

  kind: str
  m: int
  k: int
  n: int
  mesh: str = ""
  layer: str = ""
  dtype: str = DTYPE
  op: str = "gemm"

  @property
  def family(self) -> str:
    return self.name.replace(f" M{self.m} ", " ")

  @property
  def name(self) -> str:
    tag = "AG" if self.kind == "allgather" else "RS"
    return f"gemm {tag}{' ' + self.layer if self.layer else ''} M{self.m} K{self.k} N{self.n}{_on(self.mesh)}"

  @property
  def flops(self) -> float:
    return 2.0 * self.m * self.n * self.k


def _on(mesh: str) -> str:
  return f" mesh {mesh}" if mesh else ""


def size_label(n: int) -> str:
  """4096 -> "4K", 1048576 -> "1M", 200 -> "200"."""
  if n % (1 << 20) == 0:
    return f"{n >> 20}M"
  return f"{n >> 10}K" if n % 1024 == 0 else str(n)


def parse_size(text: str) -> int:
  """"4K" -> 4096, "1M" -> 1048576, "300" -> 300."""
  m = re.fullmatch(r"\s*(\d+)\s*([KkMm]?)\s*", text)
  if not m:
    raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 4K or 1M)")
  return int(m.group(1)) << {"": 0, "k": 10, "m": 20}[m.group(2).lower()]


def count(text: str) -> int:
  """A count of 0 or more from ``text`` (a flag's value)."""
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"{value} is negative (expected 0 or more)")
  return value


def llama3_layers(model: str) -> list[tuple[str, str, int, int]]:
  """``(layer, kind, K, N)`` of one model's tensor-parallel linear layers."""
  hidden, inter, heads, kv, dim = LLAMA3[model]
  return [("qkv", "allgather", hidden, (heads + 2 * kv) * dim), ("gate_up", "allgather", hidden, 2 * inter),
          ("o", "reducescatter", heads * dim, hidden), ("down", "reducescatter", inter, hidden)]


def options(args) -> dict:
  """The suite's case options: its defaults, updated by the flags given."""
  out = {"mesh": "", **SUITE_DEFAULTS.get(args.suite, {})}
  for key in ("ops", "seqs", "batches", "variants", "gemm_m", "models", "layers", "mesh"):
    if getattr(args, key) is not None:
      out[key] = getattr(args, key)
  if args.causal is not None:
    out["causal"] = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  return out


def plan(options: dict) -> list:
  """The cases of ``options`` (a suite's defaults updated by its flags) in run order: every family at the
  smallest size first, so that a time budget cuts the largest sizes."""
  out = []
  if "attention" in options["ops"]:
    families = [(ATTENTION_HEADS[v], b, c) for v in options["variants"] for b in options["batches"]
                for c in options["causal"]]
    out += [AttentionCase(b, h, kv, 128, s, c, options["mesh"]) for s in sorted(options["seqs"])
            for (h, kv), b, c in families]
  if "gemm" in options["ops"]:
    layers = [(f"{model}.{layer}", kind, k, n) for model in options["models"]
              for layer, kind, k, n in llama3_layers(model) if layer in options["layers"]]
    out += [GemmCase(kind, m, k, n, options["mesh"], layer) for m in sorted(options["gemm_m"])
            for layer, kind, k, n in layers]
  return out


def smoke_plan(suite: str) -> list:
  """Tiny cases for the simulated CPU mesh, one per suite and operator: attention on a (2, 4) mesh where USP runs,
  or on one level of 8 devices; the all-gather GEMM (gemm) and the reduce-scatter one (fused) on one level of 8."""
  return {"attention": [AttentionCase(2, 8, 2, 16, 128, True, "2x4")],
          "gemm": [GemmCase("allgather", 256, 256, 512, "8", "tiny.up")],
          "fused": [AttentionCase(1, 4, 2, 64, 128, True, "8"), GemmCase("reducescatter", 256, 512, 256, "8",
                                                                        "tiny.down")],
          "training": [AttentionCase(1, 8, 2, 16, 128, True, "8")],
          "kernels": [AttentionCase(1, 4, 2, 32, 128, True, "1")],
          "tuner": [AttentionCase(1, 8, 2, 16, 128, True, "8")]}[suite]


def case_from_dict(data: dict):
  """A case from its ``dataclasses.asdict`` form, as a results file stores it."""
  cls = AttentionCase if data.get("op") == "attention" else GemmCase
  return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
