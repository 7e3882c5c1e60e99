"""Flax NNX integration: ``distribute`` routes a module's attention, linear and MoE layers through jaxmercury."""

from jaxmercury.flax.decorate import distribute, replicate_state, rewire
from jaxmercury.flax.routes import AttentionFn, DotGeneral, MoeFn, Routing

__all__ = ["AttentionFn", "DotGeneral", "MoeFn", "Routing", "distribute", "replicate_state", "rewire"]
