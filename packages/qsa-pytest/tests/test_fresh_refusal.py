"""``refusal_in_fresh_interpreter`` reports an entry point's exit and the slow imports it made."""

from __future__ import annotations

from pathlib import Path

import pytest

from qsa_pytest.refusals import refusal_in_fresh_interpreter

ENTRY = """
import sys

def main(argv):
    print("output of main")
    if argv == ["refuse"]:
        sys.stderr.write("refused\\n")
        raise SystemExit(2)
    import decimal  # stands for a slow import
    raise SystemExit(0)
"""


@pytest.fixture
def entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "fresh_entry.py").write_text(ENTRY, encoding="utf-8")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "fresh_entry"


def test_a_refusal_before_the_slow_import_reports_none_imported(entry: str) -> None:
    ended = refusal_in_fresh_interpreter(entry, ["refuse"], watched=("decimal",))
    assert (ended.returncode, ended.stderr, ended.imported) == (2, "refused\n", frozenset())


def test_an_entry_that_goes_on_reports_what_it_imported(entry: str) -> None:
    ended = refusal_in_fresh_interpreter(entry, ["serve"], watched=("decimal", "tomllib"))
    assert (ended.returncode, ended.imported) == (0, frozenset({"decimal"}))
