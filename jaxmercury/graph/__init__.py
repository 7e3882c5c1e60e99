"""Graph-level search: operators as a DAG, candidate schedules, fused resharding on the edges.

``Graph`` holds the nodes; ``op_node`` / ``glue_node`` / ``input_node`` /
``output_node`` build them; ``measure_candidates`` replaces the operators'
predicted times with times measured on the mesh; ``search`` picks every node's candidate jointly
with the edges' resharding (``fusion`` rules applied to each edge);
``compile_plan`` runs the chosen plan; ``choose`` times the searched plans beside the
graph written as one plain function (``WholeProgram``: XLA partitions it) and
never picks a plan measured slower.
"""

from jaxmercury.analysis import collectives, fusion, hlo
from jaxmercury.analysis.collectives import Collective
from jaxmercury.analysis.fusion import RULES, Rule, fuse
from jaxmercury.analysis.layouts import Layout, enumerate_layouts, view
from jaxmercury.graph.dag import Graph, Node, glue_node, input_node, op_node, output_node
from jaxmercury.graph.execute import CompiledPlan, compile_plan
from jaxmercury.graph.options import NodeOption
from jaxmercury.graph.search import EdgePlan, GraphPlan, dynamic, exhaustive, fixed, search
from jaxmercury.graph.timing import measure_candidates
from jaxmercury.graph.whole import Choice, WholeProgram, choose

__all__ = [
    "Choice", "Collective", "CompiledPlan", "EdgePlan", "Graph", "GraphPlan", "Layout", "Node", "NodeOption", "RULES",
    "Rule", "WholeProgram", "choose", "collectives", "compile_plan", "dynamic", "enumerate_layouts", "exhaustive",
    "fixed", "fuse", "fusion", "glue_node", "hlo", "input_node", "measure_candidates", "op_node", "output_node",
    "search", "view",
]
