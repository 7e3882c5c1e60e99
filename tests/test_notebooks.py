"""The notebooks run top to bottom, unattended, on the simulated 8-device CPU mesh.

Each notebook executes in a fresh Jupyter kernel (nbclient) with
``JAX_PLATFORMS=cpu`` and 8 simulated devices; a cell that raises fails the
test. The stored notebooks carry no outputs.

Run as a script, this file executes a notebook without Jupyter, in this
process, and writes a copy with its outputs: the route for machines that have
JAX but no Jupyter (the GPU machines)::

  PYTHONPATH=. python3 tests/test_notebooks.py notebooks/quickstart.ipynb --out quickstart-2xH200.ipynb
"""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys
import traceback
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ("quickstart.ipynb", "custom_operator.ipynb")
# What each notebook's outputs must show besides running: text, and whether an image is displayed.
EXPECTED = {
    "quickstart.ipynb": (["strategies:", "Ring(k, v over x", "relative error", "winner:", "step 2: loss",
                          "jm.ops.attention"], True),
    "custom_operator.ipynb": (["PreconditionError:", "AllGather(x over dev along t)", "Ring(x over dev",
                               "[kernel gated_mlp_fused]", "winner:", "ReduceScatter(y over dev along c, sum)"],
                              False),
}


# ----------------------------------------------------------------------------- tests


def _cpu_env(tmp_path) -> dict:
  """The environment a notebook runs in: 8 simulated CPU devices, caches and files under ``tmp_path``."""
  path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ["XLA_FLAGS"], "PYTHONPATH": path,  # the tests': 8 devices
          "XDG_CACHE_HOME": str(tmp_path / "cache"), "MPLBACKEND": "Agg", "JUPYTER_PATH": str(tmp_path / "jupyter"),
          "PYDEVD_DISABLE_FILE_VALIDATION": "1"}


def _kernel_spec(tmp_path) -> str:
  """A kernel spec for this interpreter, so that a user's own ``python3`` kernel is never picked."""
  spec = tmp_path / "jupyter" / "kernels" / "jaxmercury-test"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "jaxmercury test", "language": "python"}))
  return "jaxmercury-test"


def _texts(nb) -> tuple[str, bool]:
  """All text a notebook's outputs show, and whether any output is an image."""
  texts, image = [], False
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      if out.get("output_type") == "stream":
        texts.append(out["text"])
      for mime, value in out.get("data", {}).items():
        image = image or mime.startswith("image/")
        if mime.startswith("text/"):
          texts.append(value if isinstance(value, str) else "".join(value))
  return "\n".join(texts), image


def test_stored_notebooks_have_no_outputs():
  for name in NOTEBOOKS:
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    assert nb["nbformat"] == 4
    for k, cell in enumerate(nb["cells"]):
      if cell["cell_type"] == "code":
        assert not cell["outputs"] and cell["execution_count"] is None, f"{name} cell {k} holds outputs: clear them"


def _run_notebook(name, tmp_path, monkeypatch):
  import nbformat
  from nbclient import NotebookClient
  for key, value in _cpu_env(tmp_path).items():
    monkeypatch.setenv(key, value)
  kernel = _kernel_spec(tmp_path)
  nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
  work = tmp_path / "work"
  work.mkdir()
  NotebookClient(nb, timeout=600, kernel_name=kernel, resources={"metadata": {"path": str(work)}}).execute()
  text, image = _texts(nb)
  needles, wants_image = EXPECTED[name]
  for needle in needles:
    assert needle in text, f"{name}: no output shows {needle!r}"
  assert image or not wants_image, f"{name}: no image was displayed"
  assert "Traceback" not in text


def test_quickstart_runs(tmp_path, monkeypatch):
  _run_notebook("quickstart.ipynb", tmp_path, monkeypatch)


def test_custom_operator_runs(tmp_path, monkeypatch):
  _run_notebook("custom_operator.ipynb", tmp_path, monkeypatch)


@pytest.mark.parametrize("ipython", [True, False], ids=["with_ipython", "without_ipython"])
def test_executor_records_outputs_and_stops_at_an_error(tmp_path, ipython):
  """The no-Jupyter executor: streams, displays, the last expression, and the first error; with or without IPython."""
  cells = ["print('hello')",
           "from IPython.display import Image, Markdown, display\nprint('a')\ndisplay(Markdown('| a |\\n|---|'))\n"
           "print('b')\ndisplay(Image(filename='dot.png'))\n6 * 7",
           "raise ValueError('boom')", "print('never')"]
  nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{k}", "metadata": {}, "outputs": [],
                   "source": src} for k, src in enumerate(cells)],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
  png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg==")
  (tmp_path / "dot.png").write_bytes(png)
  src, out = tmp_path / "t.ipynb", tmp_path / "out.ipynb"
  src.write_text(json.dumps(nb))
  block = "" if ipython else "sys.modules['IPython'] = None; "
  code = (f"import sys; {block}sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); "
          f"import test_notebooks; sys.exit(test_notebooks.execute({str(src)!r}, {str(out)!r}))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
  assert proc.returncode == 1 and "boom" in proc.stderr, proc.stderr
  done = json.loads(out.read_text())["cells"]
  assert done[0]["outputs"] == [{"output_type": "stream", "name": "stdout", "text": "hello\n"}]
  outputs = done[1]["outputs"]
  assert [o["output_type"] for o in outputs] == ["stream", "display_data", "stream", "display_data",
                                                 "execute_result"]
  assert [outputs[0]["text"], outputs[2]["text"]] == ["a\n", "b\n"]
  assert outputs[1]["data"]["text/markdown"] == "| a |\n|---|"
  assert base64.b64decode(outputs[3]["data"]["image/png"]) == png
  assert outputs[4]["data"]["text/plain"] == "42"
  assert done[2]["outputs"][-1]["output_type"] == "error" and done[2]["outputs"][-1]["ename"] == "ValueError"
  assert done[3]["outputs"] == [] and done[3]["execution_count"] is None


# ------------------------------------------------- executing a notebook without Jupyter


class _Recorder:
  """Collects one cell's outputs in nbformat v4 form."""

  def __init__(self):
    self.outputs: list[dict] = []
    self.stdout = io.StringIO()

  def flush(self):
    text = self.stdout.getvalue()
    if text:
      self.outputs.append({"output_type": "stream", "name": "stdout", "text": text})
    self.stdout.seek(0)
    self.stdout.truncate()

  def data(self, obj) -> dict:
    bundle = {"text/plain": repr(obj)}
    for method, mime in (("_repr_png_", "image/png"), ("_repr_markdown_", "text/markdown"),
                         ("_repr_html_", "text/html")):
      value = getattr(obj, method, lambda: None)()
      if value is None:
        continue
      if isinstance(value, tuple):  # (data, metadata)
        value = value[0]
      if isinstance(value, bytes):
        value = base64.b64encode(value).decode()
      bundle[mime] = value
    return bundle

  def display(self, *objs, **_):
    self.flush()
    for obj in objs:
      self.outputs.append({"output_type": "display_data", "data": self.data(obj), "metadata": {}})


def _display_module(recorder_of):
  """``IPython.display`` for the executor: IPython's own classes when installed, minimal ones otherwise."""
  try:
    import IPython.display as display_module
  except ImportError:
    display_module = types.ModuleType("IPython.display")

    class Markdown:
      def __init__(self, data):
        self.data = data

      def _repr_markdown_(self):
        return self.data

    class Image:
      def __init__(self, data=None, filename=None):
        self.data = pathlib.Path(filename).read_bytes() if filename else data

      def _repr_png_(self):
        return self.data

    display_module.Markdown, display_module.Image = Markdown, Image
  display_module.display = lambda *objs, **kw: recorder_of().display(*objs, **kw)
  return display_module


def _cell_builtins(display_module) -> dict:
  """Builtins for the cells: ``IPython.display`` imports get ``display_module``.

  Only the notebook's own code sees it; libraries that probe for IPython
  (matplotlib, treescope) still see the real state of the machine.
  """
  import builtins
  package = types.ModuleType("IPython")
  package.display = display_module

  def importer(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name == "IPython.display":
      return display_module if fromlist else package
    return builtins.__import__(name, globals, locals, fromlist, level)

  return {**vars(builtins), "__import__": importer}


def execute(path: str, out: str) -> int:
  """Runs a notebook's code cells in order in this process and writes them with their outputs to ``out``.

  Returns 0, or 1 after the first cell that raised (later cells are left unrun).
  """
  nb = json.loads(pathlib.Path(path).read_text())
  current: list[_Recorder] = []
  display_module = _display_module(lambda: current[0])
  namespace = {"__name__": "__main__", "__builtins__": _cell_builtins(display_module)}
  status, count = 0, 0
  for cell in nb["cells"]:
    if cell["cell_type"] != "code":
      continue
    cell["outputs"], cell["execution_count"] = [], None
    if status:
      continue
    source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    count += 1
    recorder = _Recorder()
    current[:] = [recorder]
    result = None
    try:
      with contextlib.redirect_stdout(recorder.stdout):
        tree = ast.parse(source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, f"<cell {count}>", "exec"), namespace)
        if last is not None:
          result = eval(compile(ast.Expression(last.value), f"<cell {count}>", "eval"), namespace)
    except BaseException as e:
      recorder.flush()
      lines = traceback.format_exception(e)
      recorder.outputs.append({"output_type": "error", "ename": type(e).__name__, "evalue": str(e),
                               "traceback": [line.rstrip("\n") for line in lines]})
      print(f"cell {count} failed:\n{''.join(lines)}", file=sys.stderr)
      status = 1
    recorder.flush()
    if result is not None:
      recorder.outputs.append({"output_type": "execute_result", "execution_count": count,
                               "data": recorder.data(result), "metadata": {}})
    cell["outputs"], cell["execution_count"] = recorder.outputs, count
    if not status:
      print(f"cell {count} done", file=sys.stderr, flush=True)
  pathlib.Path(out).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
  return status


if __name__ == "__main__":
  import argparse
  parser = argparse.ArgumentParser(description="Execute a notebook without Jupyter and save its outputs.")
  parser.add_argument("notebook")
  parser.add_argument("--out", required=True, help="where to write the executed notebook")
  args = parser.parse_args()
  sys.exit(execute(args.notebook, args.out))
