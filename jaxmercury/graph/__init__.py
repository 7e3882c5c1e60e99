"""Graph-level search: operators as a DAG, candidate schedules, fused resharding on the edges.

``Graph`` holds the nodes; ``op_node`` / ``glue_node`` / ``input_node`` /
``output_node`` build them; ``measure_candidates`` replaces the operators'
predicted times with times measured on the mesh; ``search`` picks every node's candidate jointly
with the edges' resharding (``fusion`` rules applied to each edge);
``compile_plan`` runs the chosen plan.
"""

from jaxmercury.graph import collectives, fusion, hlo
from jaxmercury.graph.collectives import Collective
from jaxmercury.graph.dag import Candidate, Graph, Node, glue_node, input_node, op_node, output_node
from jaxmercury.graph.execute import CompiledPlan, compile_plan
from jaxmercury.graph.fusion import RULES, Rule, fuse
from jaxmercury.graph.layouts import Layout, enumerate_layouts, view
from jaxmercury.graph.measure import measure_candidates
from jaxmercury.graph.search import EdgePlan, Plan, dynamic, exhaustive, fixed, search

__all__ = [
    "Candidate", "Collective", "CompiledPlan", "EdgePlan", "Graph", "Layout", "Node", "Plan", "RULES", "Rule",
    "collectives", "compile_plan", "dynamic", "enumerate_layouts", "exhaustive", "fixed", "fuse", "fusion",
    "glue_node", "hlo", "input_node", "measure_candidates", "op_node", "output_node", "search", "view",
]
