"""Flax NNX integration: ``distribute`` routes a module's attention and linear layers through jaxmercury."""

from jaxmercury.flax.decorate import distribute, replicate_state, rewire
from jaxmercury.flax.routes import AttentionFn, DotGeneral, Routing

__all__ = ["AttentionFn", "DotGeneral", "Routing", "distribute", "replicate_state", "rewire"]
