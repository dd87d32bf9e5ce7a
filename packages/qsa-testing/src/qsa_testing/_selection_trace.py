"""The QSA indexer's decode selections of a real engine, recorded step by step (a probe).

Two engines that should attend the same tokens (the offload against upstream) can still depart:
the indexer's block top-k may choose another block at a near-tie of its scores when the two
engines' queries differ by rounding. A comparison that sees a logprob move cannot tell that from
a wrong read unless it knows which blocks each engine selected at that step. With
:attr:`EngineConfig.trace_selection <qsa_testing.EngineConfig>` an engine's processes append
every eager decode selection of upstream's ``QSAIndexer.select_decode_tokens`` to JSON lines in
the engine's work directory; :class:`SelectionTrace` reads them back by row length and layer.

The probe changes nothing an engine computes: the wrapper asks upstream's method for the block
ids (``defer_expansion=True``) and expands them with upstream's own ``expand_qsa_block_indices``
where the caller asked for token positions, which is what the method does itself. It records
nothing while a CUDA graph is being captured, so a replayed step is not traced: only eager
decode (every CPU engine, CUDA engines with ``QSA_TESTING_CUDA_GRAPHS=0``) is.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from qsa_testing.standins._hook import after_import

__all__ = (
    "ENV_SELECTION_TRACE",
    "QSA_INDEXER_MODULE",
    "SelectionDifference",
    "SelectionTrace",
    "install_selection_probe",
    "selection_trace_directory",
    "traced_select_decode_tokens",
)

#: The directory an engine's processes append their decode selections to (set per engine by the
#: harness; unset or empty: nothing is recorded).
ENV_SELECTION_TRACE: Final = "QSA_TESTING_SELECTION_TRACE"

#: Upstream's module of ``QSAIndexer``.
QSA_INDEXER_MODULE: Final = "sglang.srt.layers.attention.qsa.qsa_indexer"
_EXPAND_MODULE: Final = "sglang.srt.layers.attention.qsa.kernel"


def selection_trace_directory(workdir: Path) -> Path:
    """Where an engine started in ``workdir`` records its selections."""
    return workdir / "selection"


def traced_select_decode_tokens(upstream: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``QSAIndexer.select_decode_tokens`` to record each eager call's block ids.

    The wrapper reads :data:`ENV_SELECTION_TRACE` at each call (a forked CPU engine sets it after
    the import). Without it, the call is upstream's. With it, each call appends one JSON line
    to ``<dir>/<pid>.jsonl``: ``{"layer": L, "lengths": [B], "blocks": [[...], ...]}``,
    each row's selected block ids ascending (``-1`` padding dropped), ``lengths`` each row's
    sequence length with the new token.
    """

    @functools.wraps(upstream)
    def select_decode_tokens(  # noqa: PLR0917 (upstream's signature)
        self: Any,
        q: Any,
        compressed_cache: Any,
        compressed_page_table: Any,
        compressed_lengths: Any,
        max_model_len: int,
        query_positions: Any,
        sequence_lengths: Any,
        defer_expansion: bool = False,
    ) -> Any:
        args = (q, compressed_cache, compressed_page_table, compressed_lengths, max_model_len)
        directory = os.environ.get(ENV_SELECTION_TRACE, "")
        if not directory:
            return upstream(
                self, *args, query_positions, sequence_lengths, defer_expansion=defer_expansion
            )
        import torch  # the engine's process has it; importing this module must not need it

        blocks = upstream(self, *args, query_positions, sequence_lengths, defer_expansion=True)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not capturing:
            _append(Path(directory), int(self.layer_id), sequence_lengths, blocks)
        if defer_expansion:
            return blocks
        expand = importlib.import_module(_EXPAND_MODULE).expand_qsa_block_indices
        return expand(
            blocks,
            query_positions,
            sequence_lengths,
            compress_ratio=self.compress_ratio,
            token_topk=self.token_topk,
        )

    return select_decode_tokens


def _append(directory: Path, layer: int, lengths: Any, blocks: Any) -> None:
    record = {
        "layer": layer,
        "lengths": [int(n) for n in lengths.tolist()],
        "blocks": [sorted(b for b in row if b >= 0) for row in blocks.tolist()],
    }
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / f"{os.getpid()}.jsonl").open("a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def _edit_indexer(module: ModuleType) -> None:
    indexer = module.QSAIndexer
    indexer.select_decode_tokens = traced_select_decode_tokens(indexer.select_decode_tokens)


def install_selection_probe() -> None:
    """Wrap upstream's ``QSAIndexer.select_decode_tokens`` once its module runs (this process).

    The engine's ``sitecustomize`` calls it in every process; it records only where
    :data:`ENV_SELECTION_TRACE` names a directory.
    """
    after_import(QSA_INDEXER_MODULE, _edit_indexer)


@dataclass(frozen=True, slots=True)
class SelectionDifference:
    """One decode step of one layer where two engines selected different blocks.

    Attributes:
        length: the row's sequence length with the step's new token (prompt + step).
        layer: the engine's layer id.
        only_first: block ids the first engine selected and the second did not.
        only_second: the other way round.
    """

    length: int
    layer: int
    only_first: tuple[int, ...]
    only_second: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SelectionTrace:
    """An engine's recorded decode selections: block ids by (row length, layer).

    Attributes:
        blocks: each (row length, layer)'s selected block ids, ascending. A row length recorded
            more than once (two requests of one length) keeps the last selection: read a
            request's selections alone with ``read(directory, after=trace_before_it)``.
        lines: the records read so far of each process's file (where a later read resumes).
    """

    blocks: Mapping[tuple[int, int], tuple[int, ...]]
    lines: Mapping[str, int]

    @classmethod
    def read(cls, directory: Path, *, after: SelectionTrace | None = None) -> SelectionTrace:
        """The records under ``directory`` (none if it does not exist).

        With ``after``, its records are left out: what the engine recorded since it was read.
        """
        blocks: dict[tuple[int, int], tuple[int, ...]] = {}
        lines: dict[str, int] = {}
        for path in sorted(directory.glob("*.jsonl")) if directory.is_dir() else ():
            text = path.read_text(encoding="utf-8").splitlines()
            lines[path.name] = len(text)
            skip = after.lines.get(path.name, 0) if after is not None else 0
            for line in text[skip:]:
                record = json.loads(line)
                for length, row in zip(record["lengths"], record["blocks"], strict=True):
                    blocks[int(length), int(record["layer"])] = tuple(row)
        return cls(blocks, lines)

    def lengths(self) -> frozenset[int]:
        """The row lengths with at least one recorded layer."""
        return frozenset(length for length, _ in self.blocks)

    def differences(
        self, other: SelectionTrace, lengths: Iterable[int]
    ) -> tuple[SelectionDifference, ...]:
        """Where ``other`` selected differently at ``lengths``, per layer this trace recorded.

        Raises:
            ValueError: a length (or a layer of it) that either trace lacks, naming it.
        """
        found = []
        for length in lengths:
            layers = sorted(layer for n, layer in self.blocks if n == length)
            if not layers:
                msg = f"no selection recorded at row length {length}; recorded: {self._span()}"
                raise ValueError(msg)
            for layer in layers:
                mine, theirs = self.blocks[length, layer], other.blocks.get((length, layer))
                if theirs is None:
                    msg = (
                        f"the other trace has no selection at row length {length}, layer "
                        f"{layer}; it recorded: {other._span()}"
                    )
                    raise ValueError(msg)
                if mine != theirs:
                    only_first = tuple(sorted(set(mine) - set(theirs)))
                    only_second = tuple(sorted(set(theirs) - set(mine)))
                    found.append(SelectionDifference(length, layer, only_first, only_second))
        return tuple(found)

    def _span(self) -> str:
        lengths = self.lengths()
        if not lengths:
            return "nothing"
        return f"{len(self.blocks)} selections, row lengths {min(lengths)}..{max(lengths)}"
