"""The benchmark suites' configurations (no JAX here: the runner plans before JAX starts).

Attention, after the Mercury evaluation (§8): MHA (32 query heads, 32
key/value heads) and GQA (32 / 8), head dimension 128, batch 1 and 16,
causal and not, sequences from 4K doubling to 1M (or further, until every
contestant fails). GEMM: the tensor-parallel linear layers of Llama-3 8B and
70B at global M (tokens) 4096 to 32768: the column-parallel layers (fused
QKV, fused gate+up) as all-gather GEMMs, the row-parallel ones (attention
output, down) as reduce-scatter GEMMs.

``--smoke`` suites are tiny versions of the same on a simulated CPU mesh:
one level of 8 devices, and a (2, 4) mesh for USP.
"""

from __future__ import annotations

import dataclasses
import re

SEQ_MIN = 4096
SEQ_MAX = 1 << 20
GEMM_M = (4096, 8192, 16384, 32768)
DTYPE = "bfloat16"

# (hidden, intermediate, query heads, kv heads, head dim) of the Llama-3 models.
LLAMA3 = {"8B": (4096, 14336, 32, 8, 128), "70B": (8192, 28672, 64, 8, 128)}


def llama3_layers(model: str) -> list[tuple[str, str, int, int]]:
  """``(layer, kind, K, N)`` of one model's tensor-parallel linear layers."""
  hidden, inter, heads, kv, dim = LLAMA3[model]
  return [("qkv", "allgather", hidden, (heads + 2 * kv) * dim),
          ("gate_up", "allgather", hidden, 2 * inter),
          ("o", "reducescatter", heads * dim, hidden),
          ("down", "reducescatter", inter, hidden)]


@dataclasses.dataclass(frozen=True)
class AttentionCase:
  """One attention configuration: its shape and the mesh it runs on.

  ``mesh`` is ``""`` (one level over every device), ``"8"`` (one level of
  8) or ``"2x4"`` (two levels, outer first); ``family`` names the sweep it
  belongs to (all its fields but ``seq``).
  """

  batch: int
  heads: int
  kv_heads: int
  head_dim: int
  seq: int
  causal: bool
  mesh: str
  dtype: str = DTYPE
  suite: str = "attention"

  @property
  def variant(self) -> str:
    return "MHA" if self.heads == self.kv_heads else ("MQA" if self.kv_heads == 1 else "GQA")

  @property
  def family(self) -> str:
    tag = " causal" if self.causal else ""
    return (f"attention {self.variant} B{self.batch} H{self.heads} KV{self.kv_heads} D{self.head_dim}{tag}"
            f"{_mesh_suffix(self.mesh)}")

  @property
  def name(self) -> str:
    tag = " causal" if self.causal else ""
    return (f"attention {self.variant} B{self.batch} S{seq_label(self.seq)} H{self.heads} KV{self.kv_heads} "
            f"D{self.head_dim}{tag}{_mesh_suffix(self.mesh)}")

  @property
  def size(self) -> int:
    return self.seq

  @property
  def flops(self) -> float:
    """Attention's matrix flops (a causal mask's visible half)."""
    dense = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
    return dense / 2 if self.causal else dense


@dataclasses.dataclass(frozen=True)
class GemmCase:
  """One GEMM: ``[M, K] @ [K, N]`` as an all-gather or reduce-scatter GEMM on ``mesh``."""

  kind: str  # "allgather" or "reducescatter"
  m: int
  k: int
  n: int
  mesh: str
  layer: str = ""
  dtype: str = DTYPE
  suite: str = "gemm"

  @property
  def family(self) -> str:
    tag = "AG" if self.kind == "allgather" else "RS"
    label = f" {self.layer}" if self.layer else ""
    return f"gemm {tag}{label} K{self.k} N{self.n}{_mesh_suffix(self.mesh)}"

  @property
  def name(self) -> str:
    tag = "AG" if self.kind == "allgather" else "RS"
    label = f" {self.layer}" if self.layer else ""
    return f"gemm {tag}{label} M{self.m} K{self.k} N{self.n}{_mesh_suffix(self.mesh)}"

  @property
  def size(self) -> int:
    return self.m

  @property
  def flops(self) -> float:
    return 2.0 * self.m * self.n * self.k


def _mesh_suffix(mesh: str) -> str:
  return f" mesh {mesh}" if mesh else ""


def seq_label(seq: int) -> str:
  """4096 -> "4K", 1048576 -> "1M", 200 -> "200"."""
  if seq % (1 << 20) == 0:
    return f"{seq >> 20}M"
  if seq % 1024 == 0:
    return f"{seq >> 10}K"
  return str(seq)


def parse_size(text: str) -> int:
  """"4K" -> 4096, "1M" -> 1048576, "300" -> 300."""
  m = re.fullmatch(r"\s*(\d+)\s*([KkMm]?)\s*", text)
  if not m:
    raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 4K or 1M)")
  return int(m.group(1)) << {"": 0, "k": 10, "m": 20}[m.group(2).lower()]


def seq_sweep(lo: int = SEQ_MIN, hi: int | None = SEQ_MAX) -> list[int] | None:
  """Doubling sequence lengths from ``lo`` to ``hi``; None when unbounded (``hi`` None)."""
  if hi is None:
    return None
  out, s = [], lo
  while s <= hi:
    out.append(s)
    s *= 2
  return out


@dataclasses.dataclass
class Selection:
  """What the command line picked (defaults: the full suites)."""

  seqs: list | None = None  # explicit sequence lengths; None: sweep SEQ_MIN..seq_max
  seq_max: int | None = SEQ_MAX  # None: keep doubling until every contestant fails
  batches: tuple = (1, 16)
  variants: tuple = ("MHA", "GQA")
  causal: tuple = (False, True)
  gemm_m: tuple = GEMM_M
  models: tuple = ("8B", "70B")
  layers: tuple = ("qkv", "gate_up", "o", "down")
  mesh: str = ""  # "": one level over every device; else e.g. "2x4"


def attention_families(sel: Selection, mesh: str) -> list[AttentionCase]:
  """One case per sweep (at the first sequence length), in run order."""
  heads = {"MHA": (32, 32), "GQA": (32, 8)}
  out = []
  for variant in sel.variants:
    h, kv = heads[variant]
    for batch in sel.batches:
      for causal in sel.causal:
        out.append(AttentionCase(batch, h, kv, 128, 0, causal, mesh))
  return out


def attention_sweeps(sel: Selection, mesh: str):
  """``(families, seqs)``: the sweeps and their sequence lengths (None: unbounded doubling)."""
  seqs = sorted(sel.seqs) if sel.seqs else seq_sweep(SEQ_MIN, sel.seq_max)
  return attention_families(sel, mesh), seqs


def gemm_sweeps(sel: Selection, mesh: str):
  """``(families, ms)``: one family per Llama-3 layer, swept over global M."""
  fams = []
  for model in sel.models:
    for layer, kind, k, n in llama3_layers(model):
      if layer in sel.layers:
        fams.append(GemmCase(kind, 0, k, n, mesh, layer=f"{model}.{layer}"))
  return fams, sorted(sel.gemm_m)


def smoke_sweeps(suite: str):
  """Tiny sweeps for the simulated CPU mesh: ``[(families, sizes)]``.

  One level of 8 devices: MHA, growing the sequence once (so that a sweep's
  growth is exercised). Two levels (2, 4): causal GQA with batch 2, where
  USP runs and the kv heads (2) are repeated for Ulysses' 4 inner ranks.
  GEMM: one all-gather and one reduce-scatter case.
  """
  out = []
  if suite in ("attention", "all"):
    out.append(([AttentionCase(1, 8, 8, 16, 0, False, "8")], [64, 128]))
    out.append(([AttentionCase(2, 8, 2, 16, 0, True, "2x4")], [128]))
  if suite in ("gemm", "all"):
    out.append(([GemmCase("allgather", 0, 256, 512, "8", layer="tiny.up"),
                 GemmCase("reducescatter", 0, 512, 256, "8", layer="tiny.down")], [256]))
  return out


def with_size(family, size: int):
  """The family's case at one sequence length (attention) or M (GEMM)."""
  if isinstance(family, AttentionCase):
    return dataclasses.replace(family, seq=size)
  return dataclasses.replace(family, m=size)


def case_from_dict(data: dict):
  """A case from its ``dataclasses.asdict`` form (as stored in a results file)."""
  cls = AttentionCase if data.get("suite") == "attention" else GemmCase
  fields = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: v for k, v in data.items() if k in fields})
