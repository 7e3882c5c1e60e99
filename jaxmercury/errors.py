"""Error types raised when a program, schedule or mesh is invalid."""


class ScheduleError(ValueError):
  """A program, schedule, mesh or layout is invalid.

  Raised before anything is traced. The message names the offending axis,
  loop, buffer, primitive or mesh level and says what would be valid.
  """


class UnknownNameError(ScheduleError, KeyError):
  """A loop, axis, buffer or mesh level name does not exist."""

  def __str__(self):
    return ValueError.__str__(self)


class PreconditionError(ScheduleError):
  """A schedule primitive was applied where its preconditions do not hold."""


class TraceError(ScheduleError):
  """A serialized schedule trace is malformed or names an unknown primitive."""
