"""Faulty matmul kernels for fault-injection tests; importing this module registers them.

They raise while tracing, return NaNs or values 1% off, fail while running
(a simulated out-of-memory), or hang in a host callback.

Tests import it inside a fixture that has swapped ``registry._KERNELS`` for a
copy (so the kernels vanish after the test); tuner worker processes import it
by name (``watchdog.kernel_modules``) so that the same kernels exist there.
"""

import threading

import jax
import jax.numpy as jnp

from jaxmercury.kernels import registry

# The hanging kernel waits for this event (a worker process never sets it and is killed).
RELEASE = threading.Event()
HANG_S = 3600.0


def _raises(ctx, a, b):
  raise ValueError("injected kernel fault")


def _nan(ctx, a, b):
  return jnp.full((a.shape[0], b.shape[1]), jnp.nan, jnp.float32)


def _wrong(ctx, a, b):
  return 1.01 * jnp.dot(a, b, preferred_element_type=jnp.float32)


def _wait(x):
  RELEASE.wait(HANG_S)
  return x


def _out_of_memory(x):
  raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1099511627776 bytes.")


def _oom(ctx, a, b):  # fails while running, as an allocation on the device would
  y = jnp.dot(a, b, preferred_element_type=jnp.float32)
  return jax.pure_callback(_out_of_memory, jax.ShapeDtypeStruct(y.shape, y.dtype), y)


def _hangs(ctx, a, b):
  y = jnp.dot(a, b, preferred_element_type=jnp.float32)
  return jax.pure_callback(_wait, jax.ShapeDtypeStruct(y.shape, y.dtype), y)


BODIES = {"test_raises": _raises, "test_nan": _nan, "test_wrong": _wrong, "test_oom": _oom, "test_hangs": _hangs}


def _make(body):
  def make(program, config, interpret):
    del program, config, interpret
    return body
  return make


KERNELS = {name: registry.Kernel(name=name, patterns=frozenset({"matmul"}), make=_make(body))
           for name, body in BODIES.items()}


def install():
  """Registers the kernels in the registry in use (idempotent)."""
  for name, kernel in KERNELS.items():
    if name not in registry._KERNELS:
      registry.register(kernel)


install()
