"""Flax NNX and JAX integration: ``distribute`` routes the attention, GEMMs and mixture-of-experts layers of a
module or function through jaxmercury operators, ``explain`` reports what it routes."""

from jaxmercury.flax.decorate import distribute, explain, replicate_state, rewire
from jaxmercury.flax.report import Entry, Report
from jaxmercury.flax.routes import AttentionFn, DotGeneral, MoeFn, Routing

__all__ = ["AttentionFn", "DotGeneral", "Entry", "MoeFn", "Report", "Routing", "distribute", "explain",
           "replicate_state", "rewire"]
