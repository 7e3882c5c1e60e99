"""The documentation's examples run, and print what the documentation says they print.

Every ```python block of a document (``docs/*.md`` and ``README.md``) runs, in
order, in one namespace per document, in a subprocess with the simulated
8-device CPU mesh. A block followed directly by an ```output block must print
exactly that text (trailing spaces and blank lines aside). ```bash blocks are
not run; ``docs/cli.md``'s flags are checked against the CLI's own.

Run as a script, this file is the runner: ``python tests/test_docs.py docs/commir.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import os
import pathlib
import re
import subprocess
import sys
import time
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\S*)[^\n]*$")


@dataclasses.dataclass
class Block:
  lang: str
  code: str
  line: int  # the first line of the code, 1-based
  expected: str | None = None  # the ```output block that follows, if any


def parse(text: str) -> list[Block]:
  """The fenced blocks of a markdown text; ```output blocks attach to the python block before them.

  Raises:
    ValueError: a fence is not closed, or an output block follows no python block.
  """
  lines = text.split("\n")
  blocks: list[Block] = []
  k, last_end = 0, -1
  while k < len(lines):
    m = FENCE.match(lines[k])
    if not m:
      k += 1
      continue
    start = k + 1
    end = next((j for j in range(start, len(lines)) if lines[j].startswith("```")), None)
    if end is None:
      raise ValueError(f"line {k + 1}: code block is not closed")
    lang, code = m.group(1), "\n".join(lines[start:end])
    if lang == "output":
      between = lines[last_end + 1:k]
      if not blocks or blocks[-1].lang != "python" or blocks[-1].expected is not None or any(x.strip()
                                                                                              for x in between):
        raise ValueError(f"line {k + 1}: an output block must directly follow a python block")
      blocks[-1].expected = code
    else:
      blocks.append(Block(lang, code, start + 1))
    last_end = end
    k = end + 1
  return blocks


def _normalize(text: str) -> list[str]:
  return [line.rstrip() for line in text.rstrip().split("\n")] if text.strip() else []


def run_document(path: pathlib.Path) -> int:
  """Runs a document's python blocks in order; prints what failed. Returns 0 when all ran as documented."""
  blocks = [b for b in parse(path.read_text()) if b.lang == "python"]
  namespace = {"__name__": "__main__"}
  for n, block in enumerate(blocks, 1):
    where = f"{path.name}, block {n} (line {block.line})"
    out, start = io.StringIO(), time.perf_counter()
    try:
      code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
      with contextlib.redirect_stdout(out):
        exec(code, namespace)
    except BaseException as e:
      print(f"FAILED {where}:\n{out.getvalue()}{''.join(traceback.format_exception(e))}")
      return 1
    if block.expected is not None and _normalize(out.getvalue()) != _normalize(block.expected):
      diff = difflib.unified_diff(_normalize(block.expected), _normalize(out.getvalue()), "documented", "printed",
                                  lineterm="")
      print(f"FAILED {where}: printed text differs from its output block\n" + "\n".join(diff))
      return 1
    print(f"ok {where}: {time.perf_counter() - start:.1f} s", flush=True)
  return 0


# ----------------------------------------------------------------------------- tests


def _run(path: pathlib.Path, tmp_path) -> subprocess.CompletedProcess:
  python_path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ["XLA_FLAGS"],  # the tests': 8 devices
         "PYTHONPATH": python_path, "XDG_CACHE_HOME": str(tmp_path / "cache"), "MPLBACKEND": "Agg"}
  # From the repository root, as a reader runs them; examples write only to temporary folders.
  return subprocess.run([sys.executable, __file__, str(path)], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=600)


@pytest.mark.parametrize("path", DOCS + [ROOT / "README.md"], ids=lambda p: p.name)
def test_examples_run_as_documented(path, tmp_path):
  proc = _run(path, tmp_path)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_runner_reports_a_wrong_output_and_an_error(tmp_path):
  doc = tmp_path / "doc.md"
  doc.write_text("Text.\n\n```python\nx = 6 * 7\nprint(x)\n```\n\n```output\n41\n```\n")
  proc = _run(doc, tmp_path)
  assert proc.returncode == 1 and "-41" in proc.stdout and "+42" in proc.stdout
  doc.write_text("```python\nx = 1\n```\n\n```bash\nnot run\n```\n\n```python\n\nraise KeyError('k')\n```\n")
  proc = _run(doc, tmp_path)
  assert proc.returncode == 1 and "block 2 (line 10)" in proc.stdout and 'doc.md", line 11' in proc.stdout


def test_parse():
  blocks = parse("a\n```python\nprint(1)\n```\n\n```output\n1\n```\n```bash\nls\n```\n")
  assert [(b.lang, b.code, b.line, b.expected) for b in blocks] == [("python", "print(1)", 3, "1"),
                                                                   ("bash", "ls", 10, None)]
  with pytest.raises(ValueError, match="directly follow"):
    parse("```python\nx\n```\nprose\n```output\n1\n```\n")
  with pytest.raises(ValueError, match="not closed"):
    parse("```python\nx\n")


def test_documents_have_examples():
  assert {p.name for p in DOCS} >= {"commir.md", "api.md", "cli.md", "database.md", "benchmarks.md"}
  for path in DOCS:
    if path.name != "index.md":
      assert any(b.lang == "python" for b in parse(path.read_text())), f"{path.name} has no python example"


def test_links_resolve():
  """Relative links in the documents and the README point at files that exist."""
  link = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
  for path in DOCS + [ROOT / "README.md"]:
    for target, _ in link.findall(path.read_text()):
      if "://" in target or target.startswith("mailto:"):
        continue
      assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_readme_links_the_documentation():
  readme = (ROOT / "README.md").read_text()
  assert "## Documentation" in readme
  section = readme.split("## Documentation", 1)[1]
  for path in DOCS:
    assert f"docs/{path.name}" in section, f"the README's Documentation section does not link docs/{path.name}"
  for name in ("quickstart.ipynb", "custom_operator.ipynb"):
    assert f"notebooks/{name}" in section


def _table_after(text: str, lead: str) -> dict[str, list[str]]:
  """The rows of the first table after the paragraph starting ``lead``, by their first cell."""
  rest = text.split("\n" + lead, 1)[1].split("\n|---", 1)[1].split("\n", 1)[1]
  rows = [line for line in rest.split("\n\n", 1)[0].splitlines() if line.startswith("|")]
  return {row.split(" | ")[0][2:]: [cell.strip() for cell in row.strip("|").split(" | ")] for row in rows}


def test_cli_doc_has_a_row_per_flag():
  """docs/cli.md has a table per operator with a row per declared parameter (its default and flag), a row per
  tuning option, and names no flag the CLI does not have: a new operator needs its table."""
  import jaxmercury as jm
  from jaxmercury import tune
  text = (ROOT / "docs" / "cli.md").read_text()
  for op in jm.programs.operators():
    rows = _table_after(text, f"`{op.name}`: ")
    for p in op.params:
      default = "none" if p.default is None else str(p.default).lower() if p.kind is bool else str(p.default)
      flag = f"`--{p.name}` / `--no{p.name}`" if p.kind is bool else f"`--{p.name}`"
      assert flag in rows and rows[flag][1].split(" (")[0] == default, (
          f"docs/cli.md's {op.name} table needs the row | {flag} | {default} | {p.help} |")
  tuning = {name.split("`")[1] for name in _table_after(text, "The mesh and the search:")} | {
      name.split("`")[1] for name in _table_after(text, "The database and the outputs:")}
  assert tuning == {f"--{p.name}" for p in tune.TUNING}, sorted(tuning ^ {f"--{p.name}" for p in tune.TUNING})
  flags = {p.name for op in jm.programs.operators() for p in op.params + tune.TUNING}
  own = re.sub(r"\n## Your own operator\n.*?(?=\n## )", "", text, flags=re.S)  # its example's flags are its own
  documented = {f for f in re.findall(r"--([a-z_]+)", own) if not f.startswith("xla_")}
  unknown = documented - flags - {f"no{name}" for name in flags} - {"help", "helpfull"}
  assert not unknown, f"docs/cli.md names flags the CLI does not have: {sorted(unknown)}"


if __name__ == "__main__":
  sys.exit(run_document(pathlib.Path(sys.argv[1]).resolve()))
