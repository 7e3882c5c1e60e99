"""Schedules: the CommIR nest of a program on a mesh, its primitives, traces, printouts and checks, and the known
strategies."""

from jaxmercury.schedules import validate
from jaxmercury.schedules.library import library
from jaxmercury.schedules.schedule import Schedule

__all__ = ["Schedule", "library", "validate"]
