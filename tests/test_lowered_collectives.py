"""The lowered program holds the collectives each strategy implies."""

import pytest
from conftest import fresh_key, make_mesh

import jaxmercury as jm

CASES = [
    ("attention", "ring", "collective_permute"),
    ("attention", "context_parallel", "all_gather"),
    ("attention", "ulysses", "all_to_all"),
    ("attention", "tree", "all_reduce"),
    ("matmul", "matmul_reducescatter", "reduce_scatter"),
    ("matmul", "allgather_matmul", "all_gather"),
    ("matmul", "async_tp", "collective_permute"),
    ("matmul", "async_tp_reducescatter", "collective_permute"),
]
ABSENT = {
    "ring": ["all_gather", "all_to_all"],
    "async_tp": ["all_gather"],
    "async_tp_reducescatter": ["reduce_scatter", "all_reduce"],
    "ulysses": ["collective_permute"],
}


def _program(kind):
  if kind == "attention":
    return jm.programs.attention(1, 8, 8, 64, 64, 16, causal=True)
  return jm.programs.matmul(64, 32, 48)


@pytest.mark.parametrize("kind,strategy,collective", CASES)
def test_strategy_lowers_to_its_collective(kind, strategy, collective):
  prog = _program(kind)
  schedule = jm.library(prog, make_mesh("8"))[strategy]
  text = schedule.compile().lower(*prog.random_inputs(fresh_key())).as_text()
  assert f"stablehlo.{collective}" in text or f'"{collective}"' in text, text[:2000]
  for absent in ABSENT.get(strategy, []):
    assert f"stablehlo.{absent}" not in text, f"{strategy} should not {absent}"


def test_ring_issues_next_transfer_before_compute():
  """Each ring step's ppermute consumes the block the step computes on, not its result."""
  prog = _program("attention")
  schedule = jm.library(prog, make_mesh("8"))["ring"]
  text = schedule.compile().lower(*prog.random_inputs(fresh_key())).as_text()
  # 7 transfers of k and 7 of v for 8 ring steps; the last step sends nothing.
  assert text.count("stablehlo.collective_permute") == 14
