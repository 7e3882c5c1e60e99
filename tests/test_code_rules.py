"""Rules of the code base that no linter checks: imports inside functions say why; JAX internals stay in one module.

The layers and the absence of import cycles are checked by ``lint-imports`` (``pyproject.toml``'s contracts)
and the style by ``ruff``, both run by ``.ci/run``.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxmercury"


def _function_imports(path):
  """(line number, source line, reason comment found) of every import inside a function of ``path``."""
  lines = path.read_text().splitlines()
  found = []

  def visit(node, inside):
    for child in ast.iter_child_nodes(node):
      if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
        found.append(child.lineno)
      visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

  visit(ast.parse("\n".join(lines)), False)
  out = []
  for n in sorted(found):
    k = n - 1  # a run of imports shares the comment of its first line, or of the line above it
    while k > 0 and (k in found) and "#" not in lines[k - 1]:
      k -= 1
    said = "#" in lines[n - 1] or "#" in lines[k - 1] or lines[k - 1].strip().startswith("#")
    out.append((n, lines[n - 1].strip(), said))
  return out


def test_imports_inside_functions_say_why():
  silent = [f"{path.relative_to(PACKAGE.parent)}:{n}: {text}" for path in sorted(PACKAGE.rglob("*.py"))
            for n, text, said in _function_imports(path) if not said]
  assert not silent, "imports inside functions without a comment saying why:\n" + "\n".join(silent)


def test_jax_internals_only_in_the_compat_module():
  users = [str(path.relative_to(PACKAGE.parent)) for path in sorted(PACKAGE.rglob("*.py"))
           if "jax._src" in path.read_text() and path.name != "_compat.py"]
  assert users == []


def _private_imports(path):
  """(line, ``module.name``) of each private name ``path`` imports from another module of the package, or reads
  off one it imported (``module._name``)."""
  tree = ast.parse(path.read_text())
  modules, found = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxmercury"):
      for alias in node.names:
        if alias.name.startswith("_") and not alias.name.startswith("__"):
          found.append((node.lineno, f"{node.module}.{alias.name}"))
        modules[alias.asname or alias.name] = node.module
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
        and node.attr.startswith("_") and not node.attr.startswith("__")):
      found.append((node.lineno, f"{node.value.id}.{node.attr}"))
  return found


def test_no_private_name_crosses_a_module():
  """A name one module needs from another is public there; the compat module's names are public too (only the
  module is private)."""
  found = [f"{path.relative_to(PACKAGE.parent)}:{n}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
           for n, name in _private_imports(path)]
  assert found == []


def test_no_function_is_longer_than_200_lines():
  """A function reads as named stages, not one closure of hundreds of lines (kernel bodies included)."""
  long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
          for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 200]
  assert long == []

def test_ci_runs_the_readmes_test_command():
  """``.ci/run`` runs the README's test command as written, which names its 25 slowest tests."""
  root = PACKAGE.parent
  readme = next(line for line in (root / "README.md").read_text().splitlines() if "python -m pytest" in line)
  command = readme.split('pip install -e ".[test]" && ', 1)[1]
  ci = [line for line in (root / ".ci" / "run").read_text().splitlines() if "python -m pytest" in line]
  assert ci and all(line.endswith(command) for line in ci), (command, ci)
  assert command.endswith("python -m pytest -n 2 --durations=25")
