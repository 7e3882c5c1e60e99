"""The autotuner: design space, measurement and the choice of a schedule."""

from jaxmercury.tuner.space import enumerate_schedules

__all__ = ["enumerate_schedules"]
