"""Schedules: the CommIR nest of a program on a mesh, and the known strategies."""

from jaxmercury.schedules.library import library
from jaxmercury.schedules.schedule import Schedule

__all__ = ["Schedule", "library"]
