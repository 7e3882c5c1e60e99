"""A model's operators as a DAG, each node with candidate placements.

Nodes are of four kinds:

- ``input``: a tensor given to the graph, in a fixed layout;
- ``op``: a jaxmercury program (GEMM, attention), one candidate per library
  schedule (``jaxmercury.graph.options``);
- ``glue``: a local function between operators (normalization, rotary
  embedding, activation, residual add), one candidate per layout it can run in;
- ``output``: the graph's result, required in a fixed layout.

A candidate fixes the layouts a node reads its inputs in and writes its
output in, and its time. An edge carries a tensor from its producer to a
consumer; when the consumer reads it in another shape (a view, such as
[tokens, heads * head_dim] read as [batch, seq, heads, head_dim]) the layout
is carried across the reshape (``layouts.view``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jaxmercury.analysis.layouts import Layout
from jaxmercury.graph.options import NodeOption, glue_candidates, op_candidates

INPUT, OP, GLUE, OUTPUT = "input", "op", "glue", "output"


@dataclasses.dataclass
class Node:
  """One operator or tensor of the graph.

  Attributes:
    name: unique name.
    kind: ``input``, ``op``, ``glue`` or ``output``.
    inputs: producer node names, in the order the node reads them.
    shape: the output's global shape (``output`` nodes: the input's).
    dtype: the output's dtype.
    input_shapes: the shape the node reads each input in.
    candidates: the ways to run it.
    fn: ``glue``: ``fn(*inputs, *params)`` on global arrays, parameters in
      ``param_keys`` order.
    reads: ``op``: per program read buffer, ``("input", index)`` or
      ``("param", key)``.
    param_keys: ``glue``: parameter keys passed to ``fn`` after the inputs.
    program: ``op``: the jaxmercury program.
  """

  name: str
  kind: str
  inputs: tuple[str, ...] = ()
  shape: tuple[int, ...] = ()
  dtype: object = np.float32
  input_shapes: tuple[tuple[int, ...], ...] = ()
  candidates: list = dataclasses.field(default_factory=list)
  fn: Callable | None = None
  reads: tuple = ()
  param_keys: tuple[str, ...] = ()
  program: object = None


@dataclasses.dataclass
class Graph:
  """Nodes in topological order on one mesh."""

  mesh: object
  nodes: list[Node] = dataclasses.field(default_factory=list)

  def add(self, node: Node) -> Node:
    names = {n.name for n in self.nodes}
    if node.name in names:
      raise ValueError(f"node {node.name!r} is already in the graph")
    missing = [p for p in node.inputs if p not in names]
    if missing:
      raise ValueError(f"node {node.name!r} reads {missing}, which are not (yet) in the graph")
    if node.kind != OUTPUT and not node.candidates:
      raise ValueError(f"node {node.name!r} has no candidate placement")
    self.nodes.append(node)
    return node

  def node(self, name: str) -> Node:
    for n in self.nodes:
      if n.name == name:
        return n
    raise KeyError(f"no node {name!r}; nodes: {[n.name for n in self.nodes]}")

  def consumers(self, name: str) -> list[tuple[str, int]]:
    """(consumer, input index) pairs that read ``name``'s output."""
    return [(n.name, i) for n in self.nodes for i, p in enumerate(n.inputs) if p == name]

  def edges(self) -> list[tuple[str, str, int]]:
    """(producer, consumer, input index) for every edge."""
    return [(p, n.name, i) for n in self.nodes for i, p in enumerate(n.inputs)]

  def space_size(self) -> int:
    """The number of joint assignments of candidates."""
    total = 1
    for n in self.nodes:
      total *= max(1, len(n.candidates))
    return total

  @property
  def sizes(self) -> dict[str, int]:
    return dict(self.mesh.shape)


def input_node(name: str, shape: Sequence[int], dtype, layout: Layout) -> Node:
  """A graph input held in ``layout``."""
  return Node(name, INPUT, (), tuple(shape), dtype, (), [NodeOption(f"given {layout}", (), layout)])


def output_node(name: str, producer: str, shape: Sequence[int], dtype, layout: Layout) -> Node:
  """The graph's result, required in ``layout``."""
  return Node(name, OUTPUT, (producer,), tuple(shape), dtype, (tuple(shape),),
              [NodeOption(f"required {layout}", (layout,), None)])


def op_node(name: str, program, *, inputs: Mapping[str, str], params: Mapping[str, str], mesh, machines,
            **options) -> Node:
  """A node running ``program``.

  Args:
    name: the node's name.
    program: a jaxmercury program.
    inputs: program read buffer -> producer node, for buffers fed by edges.
    params: program read buffer -> parameter key, for the others.
    mesh: the device mesh.
    machines: figures for the candidates' times (see ``candidates.machine_for``).
    **options: passed to ``candidates.op_candidates``.
  """
  fed = [b.name for b in program.reads if b.name in inputs]
  missing = [b.name for b in program.reads if b.name not in inputs and b.name not in params]
  if missing:
    raise ValueError(f"node {name!r}: buffers {missing} are neither inputs nor parameters")
  reads = tuple(("input", fed.index(b.name)) if b.name in inputs else ("param", params[b.name])
                for b in program.reads)
  cands = op_candidates(program, mesh, machines, activations=fed, **options)
  return Node(name, OP, tuple(inputs[b] for b in fed), tuple(program.writes.shape), program.writes.dtype,
              tuple(tuple(program.buffer(b).shape) for b in fed), cands, reads=reads, program=program)


def glue_node(name: str, fn: Callable, inputs: Sequence[str], shape: Sequence[int], dtype, *, mesh, machines,
              params: Sequence[str] = (), allowed: Callable | None = None, touches: float = 1.0) -> Node:
  """A local function of global arrays, ``fn(*inputs, *params)``, one candidate per layout it may run in.

  Every input is read in ``shape`` (the output's).
  """
  cands = glue_candidates(shape, dtype, len(inputs), mesh, machines, allowed=allowed, touches=touches)
  return Node(name, GLUE, tuple(inputs), tuple(shape), dtype, (tuple(shape),) * len(inputs), cands, fn=fn,
              param_keys=tuple(params))
