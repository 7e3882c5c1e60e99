"""Bytes moved by the collectives of a lowered program, read from its StableHLO text; collectives counted in a
compiled one.

``collective_bytes(jax.jit(f).lower(*args).as_text())`` finds every
``all_gather``, ``reduce_scatter``, ``all_reduce`` and ``all_to_all``, reads
its operand type (one device's block inside ``shard_map``) and its group size
(from the replica groups or the mesh axes they name), and applies the ring
volumes of ``jaxmercury.analysis.collectives``.

``compiled_collectives(jax.jit(f).lower(*args).compile().as_text())`` counts
the collectives XLA's partitioner left in the compiled HLO, by kind: what a
program sends after XLA partitioned it, which the lowered text does not show
for arrays XLA partitions itself.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_OP = re.compile(r'"stablehlo\.(all_gather|reduce_scatter|all_reduce|all_to_all)"')
_SIGNATURE = re.compile(r":\s*\((tensor<[^>]*>)[^)]*\)\s*->")
_MESH = re.compile(r'sdy\.mesh\s+@(\w+)\s*=\s*<\[([^\]]*)\]')
_MESH_AXES = re.compile(r"replica_group_mesh_axes<mesh\s*=\s*@(\w+),\s*axes\s*=\s*\[([^\]]*)\]")
_AXIS_REF = re.compile(r'name\s*=\s*"(\w+)"')
_DENSE_GROUPS = re.compile(r"replica_groups\s*=\s*dense<[^>]*>\s*:\s*tensor<(\d+)x(\d+)xi64>")
_DTYPES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "i64": 8, "i8": 1, "ui8": 1, "i1": 1, "ui32": 4}


@dataclasses.dataclass(frozen=True)
class HloCollective:
  """One collective found in the text."""

  kind: str
  operand_bytes: int  # one device's operand
  group: int  # devices taking part

  @property
  def bytes_moved(self) -> float:
    """Bytes one device sends (ring algorithms)."""
    n, b = self.group, self.operand_bytes
    if self.kind == "all_reduce":
      return 2 * (n - 1) / n * b
    if self.kind == "all_gather":
      return (n - 1) * b
    return (n - 1) / n * b


def _tensor_bytes(text: str) -> int:
  body = text[len("tensor<"):-1]
  *dims, dtype = body.split("x")
  return math.prod(int(d) for d in dims) * _DTYPES[dtype]


def _meshes(text: str) -> dict[str, dict[str, int]]:
  out = {}
  for name, axes in _MESH.findall(text):
    out[name] = {a: int(n) for a, n in re.findall(r'"(\w+)"\s*=\s*(\d+)', axes)}
  return out


def collectives(text: str) -> list[HloCollective]:
  """Every collective of the lowered program, in textual order."""
  meshes = _meshes(text)
  out = []
  for m in _OP.finditer(text):
    rest = text[m.end():]
    sig = _SIGNATURE.search(rest)
    head = rest[:sig.start()] if sig else rest
    named = _MESH_AXES.search(head)
    if named:
      sizes = meshes[named.group(1)]
      group = math.prod(sizes[a] for a in _AXIS_REF.findall(named.group(2)))
    else:
      dense = _DENSE_GROUPS.search(head)
      group = int(dense.group(2)) if dense else 1
    out.append(HloCollective(m.group(1), _tensor_bytes(sig.group(1)), group))
  return out


def collective_bytes(text: str) -> float:
  """Total bytes one device sends over all collectives of the program."""
  return float(np.sum([c.bytes_moved for c in collectives(text)]))


_KINDS = "all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
_COMPILED = re.compile(rf"^\s*(?:ROOT\s+)?%\S+ = .*? ({_KINDS})(?:-start)?\(", re.MULTILINE)


def compiled_collectives(text: str) -> dict[str, int]:
  """The collective instructions of a compiled program's HLO text, counted by kind (``all-gather``,
  ``all-reduce``, ``reduce-scatter``, ``all-to-all``, ``collective-permute``; an asynchronous one once, at its
  start); kinds it has none of are left out."""
  out = {}
  for m in _COMPILED.finditer(text):
    out[m.group(1)] = out.get(m.group(1), 0) + 1
  return out
