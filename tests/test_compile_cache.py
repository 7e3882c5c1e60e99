"""JAX's persistent compilation cache under a tune: a second tune of the same operator, in a new process with the
cache warm, reads the executables the first one compiled.

Each tune runs in a process of its own (``python -c``), with its own database and the same cache folder, and
reports where its time went (``TuneResult.phases``); the machine figures are given, so that both tunes choose the
same candidates.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
from jax.experimental.compilation_cache import compilation_cache

import jaxmercury as jm
from jaxmercury._cpu_flags import cpu_flags
from jaxmercury.tuner import compile_cache, cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TUNE = textwrap.dedent("""
    import json, sys
    import jax
    from jax.sharding import AxisType
    import jaxmercury as jm
    from jaxmercury.tuner import cost

    db_path, cache = sys.argv[1], sys.argv[2]
    machine = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    prog = jm.programs.attention(1, 4, 2, 128, 128, 16, causal=True)
    result = jm.autotune(prog, mesh, machine=machine, database=jm.Database(db_path), compile_cache=cache,
                         top_k=2, iters=2, compile_threads=2, log=lambda line: None)
    timed = sorted(c.name for c in result.candidates if c.status == "ok")
    print("REPORT " + json.dumps({"phases": result.phases, "timed": timed, "compiled": result.compiled,
                                  "cache_after": jax.config.jax_compilation_cache_dir}))
""")


def _tune(tmp_path, name: str, cache) -> dict:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
         "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags("", 8)}
  for variable in (compile_cache.ENV, "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
    env.pop(variable, None)  # the test session's own cache would be the user's: the tune would leave it as it is
  proc = subprocess.run([sys.executable, "-c", TUNE, str(tmp_path / f"{name}.db"), str(cache)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(next(line[len("REPORT "):] for line in proc.stdout.splitlines() if line.startswith("REPORT ")))


def test_a_second_tune_in_a_new_process_reads_the_compiled_candidates(tmp_path):
  cache = tmp_path / "cache"
  first = _tune(tmp_path, "first", cache)
  assert cache.is_dir() and len(list(cache.iterdir())) >= len(first["timed"])
  second = _tune(tmp_path, "second", cache)
  assert second["timed"] == first["timed"] and len(first["timed"]) >= 3 and first["compiled"] >= 3
  print(f"compile phase: {first['phases']['compile']:.2f} s cold, {second['phases']['compile']:.2f} s warm")
  assert second["phases"]["compile"] < 0.5 * first["phases"]["compile"], (first["phases"], second["phases"])
  assert first["cache_after"] is None and second["cache_after"] is None  # on for the tune alone


def test_the_cache_folder_is_beside_the_database_unless_named(tmp_path, monkeypatch):
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  db = tmp_path / "sub" / "tuning.db"
  assert compile_cache.folder(True, db) == str(tmp_path / "sub" / compile_cache.FOLDER)
  assert compile_cache.folder(True, None) is None and compile_cache.folder(False, db) is None
  assert compile_cache.folder(tmp_path / "mine", db) == str(tmp_path / "mine")
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
  assert compile_cache.folder(True, db) == str(tmp_path / "env")
  monkeypatch.setenv(compile_cache.ENV, "off")
  assert compile_cache.folder(True, db) is None


def test_a_users_own_cache_is_left_as_it_is(tmp_path):
  session = jax.config.jax_compilation_cache_dir  # the test session's own (conftest), restored at the end
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    with compile_cache.for_tune(str(tmp_path / "tune")) as used:
      assert used == str(tmp_path / "tune") == jax.config.jax_compilation_cache_dir
      assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_compilation_cache_dir is None
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))
    with compile_cache.for_tune(str(tmp_path / "tune")) as used:
      assert used == str(tmp_path / "users")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "users")
  finally:
    jax.config.update("jax_compilation_cache_dir", session)
    compilation_cache.reset_cache()


def test_a_tune_without_a_cache_changes_nothing(tmp_path):
  before = jax.config.jax_compilation_cache_dir
  machine = cost.Machine("test CPU", flops_per_s=10e9, link_bytes_per_s={"*": 1e9}, latency_s=50e-6)
  result = jm.autotune(jm.programs.matmul(32, 32, 32), jax.make_mesh((8,), ("x",)), space=0, top_k=1, iters=2,
                       machine=machine, database=jm.Database(tmp_path / "t.db"), compile_cache=False,
                       log=lambda line: None)
  assert result.best is not None and jax.config.jax_compilation_cache_dir == before
  assert not (tmp_path / compile_cache.FOLDER).exists()
