"""The selection probe records what upstream's QSA indexer selected and changes no result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.layers.attention.qsa.kernel import expand_qsa_block_indices

from qsa_testing import SelectionDifference, SelectionTrace
from qsa_testing._selection_trace import (
    ENV_SELECTION_TRACE,
    QSA_INDEXER_MODULE,
    traced_select_decode_tokens,
)

RATIO, TOKEN_TOPK = 4, 8  # two blocks of four tokens


class _Indexer:
    """Upstream's indexer reduced to what the probe reads: a layer and its selection widths."""

    layer_id, compress_ratio, token_topk = 3, RATIO, TOKEN_TOPK

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks
        self.deferred: list[bool] = []

    def select_decode_tokens(  # noqa: PLR0917 (upstream's signature)
        self,
        q: Any,
        cache: Any,
        table: Any,
        lengths: Any,
        max_len: int,
        positions: Any,
        sequence_lengths: torch.Tensor,
        defer_expansion: bool = False,
    ) -> torch.Tensor:
        self.deferred.append(defer_expansion)
        if defer_expansion:
            return self.blocks
        expanded: torch.Tensor = expand_qsa_block_indices(
            self.blocks, positions, sequence_lengths, compress_ratio=RATIO, token_topk=TOKEN_TOPK
        )
        return expanded


def _call(indexer: _Indexer, *, defer: bool) -> torch.Tensor:
    traced = traced_select_decode_tokens(_Indexer.select_decode_tokens)
    lengths = torch.tensor([14, 10], dtype=torch.int32)
    got: torch.Tensor = traced(
        indexer, None, None, None, None, 16, lengths - 1, lengths, defer_expansion=defer
    )
    return got


BLOCKS = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)


def test_without_a_trace_directory_the_call_is_upstreams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SELECTION_TRACE, raising=False)
    indexer = _Indexer(BLOCKS)
    want = _Indexer(BLOCKS).select_decode_tokens(
        None, None, None, None, 16, torch.tensor([13, 9]), torch.tensor([14, 10])
    )
    assert torch.equal(_call(indexer, defer=False), want)
    assert indexer.deferred == [False]


def test_a_traced_call_records_each_rows_blocks_and_returns_upstreams_expansion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_SELECTION_TRACE, str(tmp_path / "trace"))
    indexer = _Indexer(BLOCKS)
    got = _call(indexer, defer=False)
    want = expand_qsa_block_indices(
        BLOCKS, torch.tensor([13, 9]), torch.tensor([14, 10]), compress_ratio=4, token_topk=8
    )
    assert torch.equal(got, want)
    assert torch.equal(_call(indexer, defer=True), BLOCKS)
    assert indexer.deferred == [True, True]
    (path,) = (tmp_path / "trace").glob("*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == 2 * [{"layer": 3, "lengths": [14, 10], "blocks": [[0, 2], [1]]}]
    trace = SelectionTrace.read(tmp_path / "trace")
    assert trace.blocks == {(14, 3): (0, 2), (10, 3): (1,)}
    assert SelectionTrace.read(tmp_path / "trace", after=trace).blocks == {}
    monkeypatch.setattr(indexer, "blocks", torch.tensor([[1, 2], [0, 1]], dtype=torch.int32))
    _call(indexer, defer=True)
    later = SelectionTrace.read(tmp_path / "trace", after=trace)
    assert later.blocks == {(14, 3): (1, 2), (10, 3): (0, 1)}


def _write(directory: Path, *records: dict[str, Any]) -> SelectionTrace:
    directory.mkdir(parents=True)
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (directory / "1.jsonl").write_text(lines, encoding="utf-8")
    return SelectionTrace.read(directory)


def test_two_traces_differ_where_a_layer_chose_other_blocks(tmp_path: Path) -> None:
    first = _write(
        tmp_path / "a",
        {"layer": 0, "lengths": [9], "blocks": [[0, 1]]},
        {"layer": 1, "lengths": [9], "blocks": [[0, 1]]},
        {"layer": 1, "lengths": [10], "blocks": [[0, 2]]},
    )
    second = _write(
        tmp_path / "b",
        {"layer": 0, "lengths": [9], "blocks": [[0, 1]]},
        {"layer": 1, "lengths": [9], "blocks": [[1, 2]]},
        {"layer": 1, "lengths": [10], "blocks": [[0, 2]]},
    )
    assert first.lengths() == {9, 10}
    assert first.differences(second, [9, 10]) == (SelectionDifference(9, 1, (0,), (2,)),)
    assert first.differences(first, [9, 10]) == ()


def test_a_length_either_trace_lacks_is_refused_by_name(tmp_path: Path) -> None:
    first = _write(tmp_path / "a", {"layer": 0, "lengths": [9], "blocks": [[0]]})
    with pytest.raises(ValueError, match="no selection recorded at row length 10"):
        first.differences(first, [10])
    empty = SelectionTrace.read(tmp_path / "none")
    assert empty.blocks == {}
    with pytest.raises(ValueError, match=r"other trace has no selection at row length 9.*nothing"):
        first.differences(empty, [9])


def test_the_probe_wraps_upstreams_indexer_once_its_module_runs() -> None:
    """In a fresh interpreter: installed before the import, upstream's method is wrapped."""
    script = (
        "from qsa_testing._selection_trace import install_selection_probe\n"
        "install_selection_probe()\n"
        f"import {QSA_INDEXER_MODULE} as m\n"
        "method = m.QSAIndexer.select_decode_tokens\n"
        "print(method.__wrapped__.__qualname__, method.__code__.co_filename)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    wrapped, defined_in = done.stdout.split()[-2:]
    assert wrapped == "QSAIndexer.select_decode_tokens"
    assert defined_in.endswith("_selection_trace.py")
