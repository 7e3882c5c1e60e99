"""Flax NNX and JAX integration: ``distribute`` routes the attention and GEMMs of a module or function through
jaxmercury operators, ``explain`` reports what it routes."""

from jaxmercury.flax.decorate import distribute, explain, replicate_state, rewire
from jaxmercury.flax.report import Entry, Report
from jaxmercury.flax.routes import AttentionFn, DotGeneral, Routing

__all__ = ["AttentionFn", "DotGeneral", "Entry", "Report", "Routing", "distribute", "explain", "replicate_state",
           "rewire"]
