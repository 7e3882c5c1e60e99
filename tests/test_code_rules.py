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


def test_ci_runs_the_readmes_test_command():
  """``.ci/run`` runs the README's test command as written, which names its 25 slowest tests."""
  root = PACKAGE.parent
  readme = next(line for line in (root / "README.md").read_text().splitlines() if "python -m pytest" in line)
  command = readme.split('pip install -e ".[test]" && ', 1)[1]
  ci = [line for line in (root / ".ci" / "run").read_text().splitlines() if "python -m pytest" in line]
  assert ci and all(line.endswith(command) for line in ci), (command, ci)
  assert command.endswith("python -m pytest -n 2 --durations=25")
