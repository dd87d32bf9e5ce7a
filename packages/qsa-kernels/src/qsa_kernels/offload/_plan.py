"""The host side of one rank's offloaded K/V: its rows, their lengths, the planned decode step.

The offload splits along the line vLLM's ``kv_offload`` draws between a manager and its workers.
:class:`RowPlanner` is the manager: which rows hold a request (:class:`RowState`), how many
tokens each holds, which rows a decode step covers (free rows padding it to a captured batch),
and the step's plan in fixed device buffers (:class:`StepPlan`). It moves no K/V bytes. The
stores (:class:`~qsa_kernels.offload.OffloadedKV` for records of every KV head,
:class:`~qsa_kernels.offload.PerHeadOffloadedKV` for one head per record) are the workers: they
own the arena, hot caches and tails, and read the plan's buffers in every transfer and kernel.

Every check here runs before anything changes, so a refused call leaves the rows as they were.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS, TAIL_TOKENS
from qsa_kernels.sharded import ShardGroup

__all__ = ("RowPlanner", "RowState", "StepPlan", "StepRows")


class RowState(enum.Enum):
    """Occupancy of one request row of the store (its arena row, hot cache and tail).

    ``ACTIVE`` from :meth:`OffloadedKV.admit` to :meth:`OffloadedKV.release`, ``FREE`` otherwise:
    the store's own guard. It is not a request's state: that is its :class:`qsa_core.LeaseState`
    in :attr:`OffloadRuntime.leases <qsa_kernels.offload.OffloadRuntime.leases>`, whose slot is the
    row.
    """

    FREE = "free"
    ACTIVE = "active"


class StepPlan:
    """One decode step's device-side plan, in buffers allocated once for ``R`` rows.

    One int32 device vector holds, for the step's ``B`` rows (padding included): the row ids, the
    new token's offset in the tail, the row's complete blocks after the token, the block the token
    closes (``-1`` if none), the token's position and the row's open-block token ids (``[B, 3]``,
    ``-1`` padded). The host fills a pinned copy of it and moves it in one copy per step; two
    pinned copies take turns, each reused only once its previous copy has completed.

    Attributes:
        rows: the step's rows, in batch order, padding last.
        batch: ``B``.
    """

    _FIELDS = 5  # rows, tail offsets, complete blocks, closing block, position; 3 tail tokens/row

    def __init__(
        self, max_rows: int, device: torch.device, shard: ShardGroup | None = None
    ) -> None:
        self.rows: tuple[int, ...] = ()
        self._shard = shard
        self.batch = 0
        self._r = max_rows
        words = (self._FIELDS + TAIL_TOKENS) * max_rows
        self._device = torch.zeros(words, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._host = [torch.zeros(words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _field(self, index: int) -> torch.Tensor:
        return self._device[index * self._r : index * self._r + self.batch]

    @property
    def row_ids(self) -> torch.Tensor:
        """``[B]`` int32 device: the step's rows."""
        return self._field(0)

    @property
    def offsets(self) -> torch.Tensor:
        """``[B]`` int32 device: each new token's position in its row's tail record."""
        return self._field(1)

    @property
    def closed_blocks(self) -> torch.Tensor:
        """``[B]`` int32 device: each row's complete blocks, its new token included (padding: 0)."""
        return self._field(2)

    @property
    def closing(self) -> torch.Tensor:
        """``[B]`` int32 device: the arena block each new token closes, ``-1`` if none.

        Under a shard group: the local block, ``-1`` also where another rank stores it.
        """
        return self._field(3)

    @property
    def positions(self) -> torch.Tensor:
        """``[B]`` int32 device: each new token's position in its row (padding: 0)."""
        return self._field(4)

    @property
    def tail_tokens(self) -> torch.Tensor:
        """``[B, 3]`` int32 device: tail-record token ids of each row's open block (-1 padded)."""
        start = self._FIELDS * self._r
        tails = self._device[start : start + TAIL_TOKENS * self._r]
        return tails.view(self._r, TAIL_TOKENS)[: self.batch]

    def load(self, rows: Sequence[int], lengths: Sequence[int], real: int) -> None:
        """Plan rows with their lengths after the new token; the first ``real`` rows are real.

        A padding row writes its token to its own (free) tail and attends over one tail token;
        nothing of it reaches the arena or the hot cache.
        """
        host = self._host[self._turn]
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # a copy from this buffer two steps ago: long done
        words = _plan_words(rows, lengths, real, self._r, self._shard)
        host.copy_(torch.tensor(words, dtype=torch.int32))
        self._device.copy_(host, non_blocking=True)
        if self._device.is_cuda:  # each turn's one event, recorded again at its every copy
            event = self._copied[self._turn]
            if event is None:
                event = self._copied[self._turn] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        self._turn ^= 1
        self.rows, self.batch = tuple(rows), len(rows)

    def clear(self) -> None:
        self.rows, self.batch = (), 0


def _plan_words(
    rows: Sequence[int],
    lengths: Sequence[int],
    real: int,
    max_rows: int,
    shard: ShardGroup | None,
) -> list[int]:
    """:class:`StepPlan`'s vector for one step: ``5 x R`` fields, then ``[R, 3]`` tail tokens.

    Python ints, not torch operations: a step's few rows cost microseconds here, and the GPU
    waits for this host work at every decode step.
    """
    r = max_rows
    # rows, offsets, complete blocks 0; closing block -1 (none); positions 0; tail tokens -1
    words = [0] * (3 * r) + [-1] * r + [0] * r + [-1] * (TAIL_TOKENS * r)
    tails = StepPlan._FIELDS * r
    placement, rank = (None, -1) if shard is None else (shard.placement, shard.rank)
    for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        words[i] = row
        if i < real:
            position = length - 1
            offset = position % BLOCK_TOKENS
            words[r + i] = offset
            words[2 * r + i] = length // BLOCK_TOKENS
            words[4 * r + i] = position
            if offset == BLOCK_TOKENS - 1:  # the token closes its block
                block = position // BLOCK_TOKENS
                if placement is None:
                    words[3 * r + i] = block
                elif placement.block_owner(block) == rank:  # else another rank stores it
                    words[3 * r + i] = placement.block_local(block)
            count = length % BLOCK_TOKENS
        else:
            count = 1  # padding: its one (ignored) token
        at = tails + TAIL_TOKENS * i
        words[at : at + count] = [row * BLOCK_TOKENS + slot for slot in range(count)]
    return words


@dataclass(frozen=True, slots=True)
class StepRows:
    """The rows of a decode step that :meth:`RowPlanner.check_advance` accepted.

    Attributes:
        real: the requests' rows, in batch order.
        positions: each real row's new token position (its length before the step).
        padding: free rows that fill the step up to a captured batch, after the real ones.
    """

    real: tuple[int, ...]
    positions: tuple[int, ...]
    padding: tuple[int, ...]

    @property
    def rows(self) -> tuple[int, ...]:
        """The step's rows, padding last."""
        return (*self.real, *self.padding)

    @property
    def opening(self) -> list[int]:
        """The real rows whose new token opens a block (their tail records start clean)."""
        return [
            row
            for row, position in zip(self.real, self.positions, strict=True)
            if position % BLOCK_TOKENS == 0
        ]


class RowPlanner:
    """One store's rows and its decode step, on the host (see the module docstring).

    A row is ``FREE`` until :meth:`admit` records a prompt in it and again after
    :meth:`release`; a decode step is stamped (:meth:`begin_step`), checked
    (:meth:`check_advance`) and planned (:meth:`advance`) into :attr:`plan`.

    Args:
        rows: request rows ``R``.
        max_tokens: tokens one row can hold (:attr:`OffloadGeometry.max_tokens`).
        device: where the plan's buffers live (the store's device).
        shard: the store's shard group: the plan's closing blocks are then the rank's own.
    """

    def __init__(
        self,
        rows: int,
        max_tokens: int,
        device: torch.device,
        shard: ShardGroup | None = None,
    ) -> None:
        self.rows = rows
        self.max_tokens = max_tokens
        self.plan = StepPlan(rows, device, shard)
        self._lengths = [0] * rows
        self._states = [RowState.FREE] * rows
        self._step = -1
        self._planned = False

    @property
    def step(self) -> int:
        """The current decode step's number, ``-1`` before the first :meth:`begin_step`."""
        return self._step

    # -- rows --

    def length(self, row: int) -> int:
        """Tokens row ``row`` holds."""
        return self._lengths[self.check_row(row)]

    def state(self, row: int) -> RowState:
        """Whether row ``row`` holds a request (its occupancy, not a lease state)."""
        return self._states[self.check_row(row)]

    def check_row(self, row: int) -> int:
        """``row`` itself, if it is an int in ``[0, R)``."""
        given: object = row
        if not isinstance(given, int) or isinstance(given, bool) or not 0 <= row < self.rows:
            msg = f"row={row!r} is not allowed; allowed: [0, {self.rows})"
            raise KernelInputError(msg)
        return row

    def check_free(self, row: int) -> None:
        """Refuse a row that is out of range or holds a request (what an admit needs)."""
        self.check_row(row)
        if self._states[row] is not RowState.FREE:
            msg = f"row {row!r} is {self._states[row].value!r}; admit needs a free row"
            raise KernelInputError(msg)

    def check_prompt(self, tokens: int) -> None:
        """Refuse a prompt of no tokens or of more than a row holds."""
        if tokens == 0 or tokens > self.max_tokens:
            msg = f"a prompt of {tokens!r} tokens is not allowed; allowed: 1..{self.max_tokens!r}"
            raise KernelInputError(msg)

    def check_active(self, rows: Sequence[int]) -> None:
        """Refuse rows out of range, repeated, or not holding a request."""
        for row in rows:
            self.check_row(row)
        if len(set(rows)) != len(rows):
            msg = f"rows {list(rows)!r} repeat a row; each row may appear once per call"
            raise KernelInputError(msg)
        for row in rows:
            if self._states[row] is not RowState.ACTIVE:
                msg = f"row {row!r} is {self._states[row].value!r}; it must be active"
                raise KernelInputError(msg)

    def admit(self, row: int, tokens: int) -> None:
        """Record that free row ``row`` holds a prompt of ``tokens`` tokens.

        The store calls it once the prompt's bytes are on their way (after :meth:`check_free`
        and :meth:`check_prompt`).
        """
        self.check_free(row)
        self.check_prompt(tokens)
        self._lengths[row] = tokens
        self._states[row] = RowState.ACTIVE

    def release(self, row: int) -> None:
        """Free a row; a planned step that covers it is dropped."""
        self.check_row(row)
        self._states[row] = RowState.FREE
        self._lengths[row] = 0
        if row in self.plan.rows:
            self._planned = False
            self.plan.clear()

    # -- one decode step --

    def begin_step(self) -> int:
        """Start a decode step; returns its number (``0, 1, ...``)."""
        self._step += 1
        return self._step

    def check_advance(self, rows: Sequence[int], pad_to: object = None) -> StepRows:
        """The step's rows, if each is active with room for one more token; changes nothing.

        Args:
            rows: ``B`` distinct active rows.
            pad_to: the batch a captured CUDA graph was recorded for (``>= B``), or ``None``;
                the lowest free rows fill the step up to it.
        """
        self.check_active(rows)
        positions = tuple(self._lengths[row] for row in rows)
        for row, position in zip(rows, positions, strict=True):
            if position >= self.max_tokens:
                msg = f"row {row!r} is full ({self.max_tokens!r} tokens)"
                raise KernelInputError(msg)
        return StepRows(tuple(rows), positions, tuple(self._padding_rows(len(rows), pad_to)))

    def advance(self, step: StepRows) -> tuple[int, ...]:
        """Count one new token in each real row of ``step`` and load the plan; its rows.

        ``step`` comes from :meth:`check_advance`, with no row admitted or released since.
        Padding rows plan one (ignored) token each.
        """
        for row, position in zip(step.real, step.positions, strict=True):
            self._lengths[row] = position + 1
        lengths = [position + 1 for position in step.positions] + [1] * len(step.padding)
        self.plan.load(step.rows, lengths, len(step.real))
        self._planned = True
        return step.rows

    def check_planned(self, call: str, rows: Sequence[int]) -> None:
        """Refuse ``call`` unless the last :meth:`advance` planned exactly ``rows``."""
        if not self._planned or self.plan.rows != tuple(rows):
            have = list(self.plan.rows) if self._planned else None
            msg = f"{call} for rows {list(rows)!r}; the last advance() counted rows {have!r}"
            raise KernelInputError(msg)

    def check_step(self, call: str, rows: Sequence[int]) -> None:
        """Refuse ``call`` outside a stamped step planned for ``rows``."""
        if self._step < 0:
            msg = f"{call} before begin_step(); every decode step needs a stamp"
            raise KernelInputError(msg)
        self.check_planned(call, rows)

    def _padding_rows(self, real: int, pad_to: object) -> list[int]:
        """Free rows that fill a step of ``real`` rows up to ``pad_to``."""
        if pad_to is None:
            return []
        if not isinstance(pad_to, int) or isinstance(pad_to, bool) or pad_to < real:
            msg = f"pad_to={pad_to!r} is not allowed; allowed: an int >= the {real} rows"
            raise KernelInputError(msg)
        free = [r for r, state in enumerate(self._states) if state is RowState.FREE]
        if len(free) < pad_to - real:
            msg = (
                f"pad_to={pad_to!r} needs {pad_to - real} free rows to pad {real} rows; "
                f"{len(free)} of {self.rows} are free"
            )
            raise KernelInputError(msg)
        return free[: pad_to - real]
