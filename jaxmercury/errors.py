"""Error types raised when a program, schedule or mesh is invalid.

Every error is a ``ScheduleError``; the subclasses say which part is wrong,
so callers can catch one family::

  ScheduleError
    ProgramError        the operator's declaration (axes, buffers, dtypes, body)
      MaskError         an attention mask jaxmercury cannot express
    MeshError           the mesh, or a schedule built for another mesh
      UnknownLevelError a mesh level name that does not exist (also UnknownNameError)
    LayoutError         in_shardings / out_sharding against the mesh and buffer dims
    InputError          the arrays passed to a compiled schedule
    UnknownNameError    a loop, axis, buffer, kernel or level name that does not exist
    PreconditionError   a primitive applied where its preconditions do not hold
    TraceError          a serialized trace that is malformed or disagrees with its schedule
"""


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


class ProgramError(ScheduleError):
  """A program declaration is invalid: axes, buffers, dtypes, kinds, body or reduction."""


class MaskError(ProgramError):
  """An attention mask (or a ``jax.nn.dot_product_attention`` argument) that the attention programs cannot express;
  the message says which argument and what would be expressible."""


class MeshError(ScheduleError):
  """The mesh is unusable, or does not match the one a schedule was built for."""


class UnknownLevelError(UnknownNameError, MeshError):
  """A mesh level name does not exist on the mesh."""


class LayoutError(ScheduleError):
  """An input or output sharding does not fit the mesh or the buffer's dimensions."""


class InputError(ScheduleError):
  """Arrays passed to a compiled schedule have the wrong number, shape, dtype or devices."""
