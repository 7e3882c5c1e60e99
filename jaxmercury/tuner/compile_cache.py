"""JAX's persistent compilation cache, on for what a tune compiles.

A tune compiles its candidates, their training steps, the reference and the
calibration's probes; a second tune of the same operator, another process
of the same job, or the next run compiles the same programs again. JAX's
persistent cache (``jax_compilation_cache_dir``) keeps the executables on
disk, keyed by the program, the devices and the compile options, so those
compiles become reads. It works on CPUs as on GPUs; every entry is written
(a candidate compiles in well under JAX's default threshold of one second on
CPUs), and only by process 0 under ``jax.distributed`` (JAX's rule).

The cache is switched on for the tune alone (``for_tune``): a user's own
programs compiled outside a tune are not written to it, since the folder
grows with every program cached and JAX reads it as trusted code; where the
user already set ``jax_compilation_cache_dir``, their cache serves the tune
and nothing is changed. JAX reads the folder and the thresholds when it first
looks for a cache, so switching it on and off resets JAX's cache state
(``compilation_cache.reset_cache``, JAX's public call for that).

Folder: ``$JAXMERCURY_COMPILE_CACHE`` where set (``off`` switches the cache
off), else beside the tuning database (``<database folder>/xla-cache``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV = "JAXMERCURY_COMPILE_CACHE"
OFF = ("off", "0", "false", "no", "")
FOLDER = "xla-cache"
# the configuration a tune's cache sets, and restores afterwards
_SETTINGS = {"jax_compilation_cache_dir": None, "jax_persistent_cache_min_compile_time_secs": 0.0,
             "jax_persistent_cache_min_entry_size_bytes": -1}
_lock = threading.Lock()
_active = {"tunes": 0, "before": None}  # tunes running with the cache on (in threads), the settings to restore


def folder(setting, database_path: str | os.PathLike | None) -> str | None:
  """The cache folder for a tune, or None for no cache.

  Args:
    setting: ``TuneConfig.compile_cache``: True (the default place), False (off) or a folder.
    database_path: the tuning database's file, if any; the default folder is beside it.
  """
  if setting is False:
    return None
  if setting is not True:
    return os.fspath(setting)
  env = os.environ.get(ENV)
  if env is not None:
    return None if env.strip().lower() in OFF else env
  if database_path is None:
    return None
  return os.path.join(os.path.dirname(os.path.abspath(os.fspath(database_path))), FOLDER)


def users_cache() -> str | None:
  """The folder of a persistent cache the user switched on (``jax_compilation_cache_dir``), or None."""
  return jax.config.jax_compilation_cache_dir


@contextlib.contextmanager
def for_tune(path: str | None):
  """JAX's persistent cache in ``path`` while the block runs (nothing where ``path`` is None or the user has a
  cache of their own); the previous settings once the last tune running with it (tunes may run in threads)
  ends. Yields the folder in use, or None."""
  with _lock:
    mine = _active["tunes"] > 0 or (path is not None and users_cache() is None and _switch_on(path))
    if mine:
      _active["tunes"] += 1
    used = users_cache()
  try:
    yield used
  finally:
    if mine:
      with _lock:
        _active["tunes"] -= 1
        if _active["tunes"] == 0:
          _restore()


def _switch_on(path: str) -> bool:
  """Sets the tune's cache up; False (and nothing changed) where its folder cannot be made."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    warnings.warn(f"the compilation cache folder {path!r} cannot be made ({e}); tuning without it",
                  RuntimeWarning, stacklevel=4)
    return False
  _active["before"] = {name: getattr(jax.config, name) for name in _SETTINGS}
  for name, value in {**_SETTINGS, "jax_compilation_cache_dir": path}.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  return True


def _restore():
  for name, value in _active["before"].items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()
