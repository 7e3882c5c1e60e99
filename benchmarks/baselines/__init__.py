"""Plain-JAX baselines that jaxmercury schedules are measured against."""
