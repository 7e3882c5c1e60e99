"""Training the Llama model with optax: next-token cross-entropy, AdamW, one jitted step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


def loss_fn(model, tokens):
  """Mean next-token cross-entropy of ``tokens [batch, seq + 1]``."""
  logits = model(tokens[:, :-1])
  labels = tokens[:, 1:]
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def make_optimizer(model, *, learning_rate: float = 1e-3, weight_decay: float = 0.0) -> nnx.Optimizer:
  """AdamW over the model's parameters."""
  return nnx.Optimizer(model, optax.adamw(learning_rate, weight_decay=weight_decay), wrt=nnx.Param)


@functools.partial(nnx.jit, static_argnames=("mesh",))
def train_step(model, optimizer, tokens, mesh=None):
  """One optimizer step on a batch; returns the loss before the step.

  With ``mesh``, the updated model and optimizer states are kept replicated
  over it, so every step sees the same input shardings and compiles once
  (place them with ``jaxmercury.flax.replicate_state`` before the first).
  """
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
  optimizer.update(model, grads)
  if mesh is not None:
    replicated = NamedSharding(mesh, PartitionSpec())
    for obj in (model, optimizer):
      nnx.update(obj, jax.lax.with_sharding_constraint(nnx.state(obj), replicated))
  return loss


def random_tokens(key, batch: int, seq: int, vocab: int):
  """A batch of ``seq + 1`` random tokens per row (inputs and next-token labels)."""
  return jax.random.randint(key, (batch, seq + 1), 0, vocab)
