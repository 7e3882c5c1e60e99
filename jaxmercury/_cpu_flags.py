"""XLA's flags for the CPU platform that simulates meshes, set in ``XLA_FLAGS`` before JAX makes its CPU client.

Mosaic GPU interpret mode runs each of a kernel's threads as an XLA execution of its own, started from inside a
host callback of the program that calls the kernel. XLA's concurrency-optimized scheduler lets independent
kernels of one program run at once on XLA's CPU thread pool, one thread per core: on a machine of two cores both
pool threads can then wait inside kernels whose threads need a pool thread to run, and the program hangs (as a
causal training step of the fused ring attention with our backward kernel does). With the scheduler off, such
kernels run one after another.
"""

DEVICE_COUNT = "--xla_force_host_platform_device_count"
SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler"
SEQUENTIAL_KERNELS = f"{SCHEDULER}=false"


def cpu_flags(flags: str, devices: int | None = None) -> str:
  """``flags`` (an ``XLA_FLAGS`` value) with interpret-mode kernels run one at a time and, where ``devices`` is
  given, that many simulated CPU devices (replacing a count ``flags`` names)."""
  parts = flags.split()
  if devices is not None:
    parts = [p for p in parts if not p.startswith(f"{DEVICE_COUNT}=")] + [f"{DEVICE_COUNT}={devices}"]
  if not any(p.startswith(SCHEDULER) for p in parts):
    parts.append(SEQUENTIAL_KERNELS)
  return " ".join(parts)
