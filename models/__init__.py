"""Models built on jaxmercury: a Llama-3-style decoder in Flax NNX, its training step, its block as a graph.

``llama``: configurations (``CONFIGS``: tiny to Llama-3 8B/70B layer sizes),
``DecoderBlock`` and ``Llama``; ``train``: loss, optimizer and a jitted
training step; ``block_graph``: one decoder block as a ``jaxmercury.graph``
DAG for graph-level search, and the plan run on the block's parameters.
Apply ``jaxmercury.distribute`` to a model to run its attention and linear
layers as jaxmercury operators.
"""

from models.llama import CONFIGS, MLP, Attention, DecoderBlock, Llama, LlamaConfig, RMSNorm
from models.train import loss_fn, make_optimizer, random_tokens, train_step

__all__ = ["Attention", "CONFIGS", "DecoderBlock", "Llama", "LlamaConfig", "MLP", "RMSNorm", "loss_fn",
           "make_optimizer", "random_tokens", "train_step"]
