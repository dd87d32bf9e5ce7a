"""The offloaded K/V of the QSA layers: host arena, per-request hot caches and open-block tails.

This composes the decode-path kernels into the data path of one rank. Each request row keeps its
whole raw K/V history in a pinned host arena (``host_arena``: the request K/V arena, one fixed row
per request; not qsa-hostcache's byte arena of prefix checkpoints); the device holds, per (layer,
row), a hot cache of ``S`` block slots governed by the ``qsa_core`` residency contract, plus the
open (incomplete) block of the row. A decode step of one layer fetches the selected blocks that
miss, attends over them in the hot cache and over the open block in the tail, and merges the two
parts by their LSE.

A decode step is planned on the host (:meth:`OffloadedKV.advance`) into fixed device buffers: the
step's rows, each new token's tail offset, each row's complete blocks, the block a token closes,
the open-block token ids. Everything after the plan (token writes, the masked write-back of closed
blocks, fetch, sparse decode, merge) reads only those buffers and a device stamp counter, never a
host value, so one layer's step can be captured in a CUDA graph once per batch size and replayed:
the plan pads the batch with free rows, whose work is masked out.

A record holds one 4-token block of every KV head, as QSA's indexer selects blocks for all heads
at once. Where each KV head chooses its own tokens (double sparsity), per-head records
(:attr:`OffloadGeometry.per_head`) hold one head each, so a head's choice moves only its own
bytes: :meth:`OffloadedKV.token_blocks` and :meth:`OffloadedKV.attend_tokens` read them.

Under a shard group (``shard``: ``N`` ranks holding the same K/V heads, e.g. the copies of one KV
head at TP > KV heads), each rank's arena stores only the blocks its placement gives it: whole
16-block pages, page ``p`` of a request on rank ``p % N`` (the compressed index's page
interleaving, :func:`qsa_kernels.sharded.localize_blocks`), so host bytes and fetches divide by
``N``. Every rank keeps the open-block tail; rank 0 alone attends it. :meth:`OffloadedKV.attend`
then returns this rank's partial, which :func:`qsa_kernels.sharded.merge_owner_partials` combines
across the group.

Ordering across streams is explicit: a prompt is offloaded on a side stream, and the current
stream waits on that copy's event before the next step. Closed blocks are written back on the
current stream, in order. Nothing here allocates pinned memory after construction.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qsa_core import OffloadSizes
from qsa_kernels._checks import KV_DTYPES
from qsa_kernels._errors import KernelInputError
from qsa_kernels._geometry import BLOCK_TOKENS
from qsa_kernels._path import KernelPath
from qsa_kernels.fetch import (
    MAX_HOT_SLOTS,
    HotCacheTables,
    fetch_selected_blocks,
    fetch_selected_blocks_reference,
)
from qsa_kernels.lse_merge import lse_merge, lse_merge_reference
from qsa_kernels.sharded import ShardGroup, localize_blocks
from qsa_kernels.sparse_decode import (
    sparse_decode,
    sparse_decode_reference,
    sparse_decode_split,
    sparse_decode_split_reference,
)
from qsa_kernels.writeback import (
    offload_prompt,
    offload_prompt_reference,
    writeback_blocks,
    writeback_blocks_reference,
)

__all__ = ("KVComparison", "OffloadGeometry", "OffloadedKV", "RowState")


class RowState(enum.Enum):
    """Occupancy of one request row of the store (its arena row, hot cache and tail).

    ``ACTIVE`` from :meth:`OffloadedKV.admit` to :meth:`OffloadedKV.release`, ``FREE`` otherwise:
    the store's own guard. It is not a request's state: that is its :class:`qsa_core.LeaseState`
    in :attr:`OffloadRuntime.leases <qsa_kernels.offload.OffloadRuntime.leases>`, whose slot is the
    row.
    """

    FREE = "free"
    ACTIVE = "active"


@dataclass(frozen=True, slots=True)
class OffloadGeometry:
    """Sizes of one rank's offloaded K/V.

    Attributes:
        layers: QSA layers ``L`` (12 for Qwen3.8-Flash-Next).
        rows: request rows ``R`` (concurrent requests).
        hot_slots: hot-cache block slots ``S`` per (layer, row); at least the block top-k.
        max_blocks: host arena blocks ``NB`` per (row, layer): ``ceil(max_context / 4)``.
        kv_heads: K/V heads per rank ``Hkv``.
        head_dim: ``D``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.bfloat16``.
        per_head: what one record holds. ``False``: one block of every KV head, ``[2, 4, Hkv,
            D]``, since QSA's indexer picks blocks for all heads at once. ``True``: one block of
            one KV head, ``[2, 4, 1, D]``, for selections made per KV head (double sparsity), so
            a head's choice fetches only its own bytes; the store then keeps ``L × Hkv`` record
            layers (:attr:`store_layers`), layer ``l``'s head ``h`` at ``l × Hkv + h``, and
            ``hot_slots`` counts the slots of one head.
    """

    layers: int
    rows: int
    hot_slots: int
    max_blocks: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    per_head: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "rows", "hot_slots", "max_blocks", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                msg = f"{name}={value!r} is not allowed; it must be a positive integer"
                raise KernelInputError(msg)
        if self.hot_slots > MAX_HOT_SLOTS:
            msg = f"hot_slots={self.hot_slots!r} is not allowed; allowed: 1 to {MAX_HOT_SLOTS!r}"
            raise KernelInputError(msg)
        if self.dtype not in KV_DTYPES:
            msg = f"dtype={self.dtype!r} is not allowed; allowed: {KV_DTYPES!r}"
            raise KernelInputError(msg)
        per_head: object = self.per_head
        if not isinstance(per_head, bool):
            msg = f"per_head={self.per_head!r} is not allowed; allowed: True or False"
            raise KernelInputError(msg)

    @property
    def sizes(self) -> OffloadSizes:
        """The same sizes for qsa-core's arithmetic (:class:`qsa_core.OffloadSizes`).

        Every byte count below is computed there, once: the engine's pool sizing and the
        capacity plan read the same figures.
        """
        return OffloadSizes(
            layers=self.layers,
            rows=self.rows,
            hot_slots=self.hot_slots,
            max_blocks=self.max_blocks,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            element_bytes=torch.empty((), dtype=self.dtype).element_size(),
            per_head=self.per_head,
            block_tokens=BLOCK_TOKENS,
        )

    @property
    def max_tokens(self) -> int:
        """Tokens one row can hold (``NB × 4``)."""
        return self.max_blocks * BLOCK_TOKENS

    @property
    def record_heads(self) -> int:
        """KV heads one record holds: ``Hkv``, or 1 with :attr:`per_head`."""
        return 1 if self.per_head else self.kv_heads

    @property
    def store_layers(self) -> int:
        """Record layers ``Ls`` of the arena, hot caches and tails: ``L``, or ``L × Hkv``."""
        return self.sizes.store_layers

    @property
    def record_shape(self) -> tuple[int, int, int, int]:
        """One block of one record layer: ``[2, 4, Hr, D]`` (its K rows, then its V rows)."""
        return (2, BLOCK_TOKENS, self.record_heads, self.head_dim)

    @property
    def record_bytes(self) -> int:
        """Bytes of one record (one block of one record layer, K and V)."""
        return self.sizes.record_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes of the host arena: ``R × Ls × NB`` records."""
        return self.arena_bytes()

    def arena_blocks(self, shard: ShardGroup | None = None) -> int:
        """Arena blocks per (row, layer) one rank stores.

        ``NB``, or under ``shard`` the blocks of ``[0, NB)`` its placement gives the rank
        (``ceil(NB / 16 / N)`` pages at most).
        """
        if shard is None:
            return self.max_blocks
        return shard.placement.blocks_on_rank(self.max_blocks, shard.rank)

    def arena_bytes(self, shard: ShardGroup | None = None) -> int:
        """Bytes of one rank's host arena: ``R × Ls ×`` :meth:`arena_blocks` records."""
        return self.sizes.arena_bytes(self.arena_blocks(shard))

    @property
    def device_bytes(self) -> int:
        """Device bytes :class:`OffloadedKV` allocates: hot caches, tails and residency tables.

        ``Ls × R × (S + 1)`` records, plus ``Ls × R × S`` int32 block ids and int64 stamps and
        ``Ls × R × NB`` int32 slots (a bound: a shard's slot maps cover its own blocks)
        (:attr:`qsa_core.OffloadSizes.device_bytes`).
        """
        return self.sizes.device_bytes


@dataclass(frozen=True, slots=True)
class _Kernels:
    """The operations of the data path, from one implementation (see :class:`KernelPath`).

    The write-back and prompt offload return the event that completes them (``None`` when they
    ran synchronously).
    """

    fetch: Callable[..., torch.Tensor]
    decode: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    decode_split: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    merge: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    writeback: Callable[..., torch.cuda.Event | None]
    offload: Callable[..., torch.cuda.Event | None]


def _writeback_reference(*args: Any, **kwargs: Any) -> None:
    writeback_blocks_reference(*args, **kwargs)


def _offload_reference(*args: Any, **kwargs: Any) -> None:
    offload_prompt_reference(*args, **kwargs)


_KERNELS = {
    KernelPath.TRITON: _Kernels(
        fetch=fetch_selected_blocks,
        decode=sparse_decode,
        decode_split=sparse_decode_split,
        merge=lse_merge,
        writeback=writeback_blocks,
        offload=lambda *args, **kwargs: offload_prompt(*args, **kwargs)[1],
    ),
    KernelPath.REFERENCE: _Kernels(
        fetch=fetch_selected_blocks_reference,
        decode=sparse_decode_reference,
        decode_split=sparse_decode_split_reference,
        merge=lse_merge_reference,
        writeback=_writeback_reference,
        offload=_offload_reference,
    ),
}


@dataclass(frozen=True, slots=True)
class KVComparison:
    """What :meth:`OffloadedKV.compare` found.

    Attributes:
        bytes_compared: K and V bytes of the row's tokens, every layer (under a shard group:
            of its own blocks and its tail).
        bytes_differing: those that differ from the expected K/V (0 when the offload is exact).
    """

    bytes_compared: int
    bytes_differing: int


def _differing_bytes(have: torch.Tensor, want: torch.Tensor) -> int:
    """Bytes of ``have`` that differ from ``want`` (same shape and dtype, any devices)."""
    a = have.contiguous().view(torch.uint8).cpu()
    b = want.contiguous().view(torch.uint8).cpu()
    return int((a != b).sum())


#: Rows of ``D`` elements in one per-head record: its 4 K rows, then its 4 V rows.
_RECORD_ROWS = 2 * BLOCK_TOKENS


def _head_records(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of one layer's per-head record layers as ``[N, Hkv, D]`` views (no copy).

    ``cache`` is ``[Hkv, R, S', 2, 4, 1, D]`` (a hot cache, or tails with ``S' = 1``); token
    ``_RECORD_ROWS × r + o`` of the K view is token ``o`` of record ``r = row × S' + slot``, and
    the same id in the V view (``BLOCK_TOKENS`` rows later) is its value.
    """
    heads, d = int(cache.shape[0]), int(cache.shape[-1])
    rows = cache.view(heads, -1, d).permute(1, 0, 2)  # [R S' 8, Hkv, D]
    return rows[:-BLOCK_TOKENS], rows[BLOCK_TOKENS:]


class _StepPlan:
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
        words = (self._FIELDS + BLOCK_TOKENS - 1) * max_rows
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
        tails = self._device[start : start + (BLOCK_TOKENS - 1) * self._r]
        return tails.view(self._r, BLOCK_TOKENS - 1)[: self.batch]

    def load(self, rows: Sequence[int], lengths: Sequence[int], real: int) -> None:
        """Plan rows with their lengths after the new token; the first ``real`` rows are real.

        A padding row writes its token to its own (free) tail and attends over one tail token;
        nothing of it reaches the arena or the hot cache.
        """
        r, n = self._r, len(rows)
        host = self._host[self._turn]
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # a copy from this buffer two steps ago: long done
        fields = host[: self._FIELDS * r].view(self._FIELDS, r)
        fields.fill_(0)
        fields[3].fill_(-1)
        tails = host[self._FIELDS * r :].view(r, BLOCK_TOKENS - 1)
        tails.fill_(-1)
        if n:
            row_t = torch.tensor(rows, dtype=torch.int32)
            length_t = torch.tensor(lengths, dtype=torch.int32)
            position = length_t - 1
            offset = position % BLOCK_TOKENS
            open_count = length_t % BLOCK_TOKENS
            is_real = torch.arange(n) < real
            fields[0, :n] = row_t
            fields[1, :n] = torch.where(is_real, offset, 0)
            fields[2, :n] = torch.where(is_real, length_t // BLOCK_TOKENS, 0)
            closes = is_real & (offset == BLOCK_TOKENS - 1)
            closing = torch.where(closes, position // BLOCK_TOKENS, -1)
            if self._shard is not None:
                closing = localize_blocks(closing, self._shard.placement, self._shard.rank)
            fields[3, :n] = closing
            fields[4, :n] = torch.where(is_real, position, 0)
            count = torch.where(is_real, open_count, 1)  # padding: its one (ignored) token
            slots = torch.arange(BLOCK_TOKENS - 1, dtype=torch.int32)
            tails[:n] = torch.where(
                slots < count.unsqueeze(1), row_t.unsqueeze(1) * BLOCK_TOKENS + slots, -1
            )
        self._device.copy_(host, non_blocking=True)
        if self._device.is_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._copied[self._turn] = event
        self._turn ^= 1
        self.rows, self.batch = tuple(rows), n

    def clear(self) -> None:
        self.rows, self.batch = (), 0


class OffloadedKV:
    """One rank's QSA K/V under host offload (see the module docstring).

    Shapes: host arena (``host_arena``, the request K/V arena) ``[R, Ls, NB, 2, 4, Hr, D]``
    (pinned where CUDA exists), hot cache ``[Ls, R, S, 2, 4, Hr, D]``, open-block tails ``[Ls, R,
    1, 2, 4, Hr, D]`` (device), residency tables :class:`~qsa_kernels.fetch.HotCacheTables`; ``Ls,
    Hr`` are ``L, Hkv``, or ``L × Hkv, 1`` with per-head records (:attr:`OffloadGeometry.per_head`).
    Every method takes and returns K/V by logical layer and head. Token counts per row are
    tracked on the host.

    A decode step either appends every layer's token at once (:meth:`append`), or, as a model's
    forward pass produces them, counts the token once (:meth:`advance`) and then writes it layer
    by layer (:meth:`write_token`) just before that layer attends (:meth:`attend`).

    ``path`` picks the implementation: the Triton kernels, or their torch references (same
    contract; what a CPU-only engine runs). :attr:`KernelPath.AUTO` takes Triton on CUDA.

    ``shard``: this rank's shard group (see the module docstring); the arena is then
    ``[R, L, NB_local, ...]`` with ``NB_local = geometry.arena_blocks(shard)``, and block ids
    given to and returned by every method stay request-relative. A group of one rank is no shard.
    """

    def __init__(
        self,
        geometry: OffloadGeometry,
        device: torch.device,
        *,
        path: KernelPath = KernelPath.AUTO,
        shard: ShardGroup | None = None,
    ) -> None:
        self.geometry = geometry
        g = geometry
        self.shard = shard if shard is not None and shard.world_size > 1 else None
        blocks = g.arena_blocks(self.shard)
        pin = device.type == "cuda"
        layers = g.store_layers
        self.host_arena = torch.empty(
            (g.rows, layers, blocks, *g.record_shape), dtype=g.dtype, pin_memory=pin
        )
        self.hot = torch.zeros(
            (layers, g.rows, g.hot_slots, *g.record_shape), dtype=g.dtype, device=device
        )
        self.tail = torch.zeros((layers, g.rows, 1, *g.record_shape), dtype=g.dtype, device=device)
        # The device of a real allocation ("cuda" resolves to "cuda:<index>").
        self.device = self.hot.device
        self.path = path.resolve(self.device)
        self._kernels = _KERNELS[self.path]
        self.tables = HotCacheTables.empty(layers, g.rows, g.hot_slots, blocks, device)
        self._lengths = [0] * g.rows
        self._states = [RowState.FREE] * g.rows
        self._step = -1
        self._pending: list[torch.cuda.Event] = []
        self._layer_ids = torch.arange(layers, dtype=torch.int32, device=self.device)
        self._block_offsets = torch.arange(BLOCK_TOKENS, dtype=torch.int32, device=self.device)
        self._head_ids = torch.arange(g.kv_heads, device=self.device)
        # The write-back's fixed index vectors, sliced per call: every entry's source slot (the
        # tail record, 0) and each record layer's id repeated for every row ([Ls, R]).
        self._zero_slots = torch.zeros(layers * g.rows, dtype=torch.int32, device=self.device)
        self._layer_of = self._layer_ids.repeat_interleave(g.rows).view(layers, g.rows)
        # Hot-cache stamps: every fetch reads this counter and advances it by one, on the device.
        self._stamp = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._plan = _StepPlan(g.rows, self.device, self.shard)
        self._planned = False
        # One rank of a shard group attends the open block; the others read no tail token.
        self._attends_tail = self.shard is None or self.shard.rank == 0
        self._no_tail = torch.full(
            (g.rows, BLOCK_TOKENS - 1), -1, dtype=torch.int32, device=self.device
        )

    # -- request lifecycle --

    def length(self, row: int) -> int:
        """Tokens row ``row`` holds."""
        return self._lengths[self._check_row(row)]

    def admit(
        self,
        row: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        prefix: torch.Tensor | None = None,
    ) -> torch.cuda.Event | None:
        """Take a prefilled prompt into a free row: complete blocks to host, the open block to tail.

        With ``prefix`` (the records of a cached prefix, e.g. restored from a host prefix cache),
        the prompt is ``prefix`` followed by ``k``/``v``: the prefix records go to the row's first
        arena blocks as they are, and only the new tokens are offloaded after them.

        Args:
            row: a free request row.
            k: ``[L, T, Hkv, D]`` keys of every QSA layer for the tokens after the prefix
                (device, the geometry's dtype); ``T`` may be 0 only with a prefix.
            v: ``[L, T, Hkv, D]`` values.
            prefix: ``[L, P, 2, 4, Hkv, D]`` records of the first ``P`` complete blocks
                (``4 P`` tokens), any device, the geometry's dtype; ``None`` for no prefix
                (always with per-head records).

        Returns:
            The event that completes the copy to the host (on a side stream), or None when the
            copy ran synchronously. Later steps of this store are ordered after it themselves.
        """
        self._check_row(row)
        if self._states[row] is not RowState.FREE:
            msg = f"row {row!r} is {self._states[row].value!r}; admit needs a free row"
            raise KernelInputError(msg)
        g = self.geometry
        expected = (g.layers, k.shape[1] if k.dim() == 4 else -1, g.kv_heads, g.head_dim)
        if k.dim() != 4 or tuple(k.shape) != expected or tuple(v.shape) != expected:
            msg = (
                f"k and v must be [L={g.layers}, T, Hkv={g.kv_heads}, D={g.head_dim}]; got "
                f"{tuple(k.shape)!r} and {tuple(v.shape)!r}"
            )
            raise KernelInputError(msg)
        if prefix is not None and g.per_head:
            msg = "admit with a prefix takes every head's records; this store keeps one per head"
            raise KernelInputError(msg)
        k, v = self._record_layers(k), self._record_layers(v)
        prefix_blocks = 0 if prefix is None else int(prefix.shape[1]) if prefix.dim() == 6 else -1
        if prefix is not None and (
            prefix_blocks < 0
            or tuple(prefix.shape) != (g.layers, prefix_blocks, *g.record_shape)
            or prefix.dtype != g.dtype
        ):
            msg = (
                f"prefix must be [L={g.layers}, P, {', '.join(map(str, g.record_shape))}] "
                f"{g.dtype}; got {tuple(prefix.shape)!r} {prefix.dtype}"
            )
            raise KernelInputError(msg)
        first = prefix_blocks * BLOCK_TOKENS
        tokens = first + int(k.shape[1])
        if tokens == 0 or tokens > g.max_tokens:
            msg = f"a prompt of {tokens!r} tokens is not allowed; allowed: 1..{g.max_tokens!r}"
            raise KernelInputError(msg)
        self.tables.reset_rows(torch.tensor([row], device=self.device))
        owned_prefix = self._owned_blocks(0, prefix_blocks)
        if prefix is not None:
            self.wait_for_host_writes()
            if self.device.type == "cuda":  # the arena may still be read by queued fetches
                torch.cuda.current_stream(self.device).synchronize()
            self.host_arena[row, :, : len(owned_prefix)].copy_(
                prefix if self.shard is None else prefix[:, owned_prefix]
            )
        # The new tokens' blocks go to the arena after the prefix's (local ids are consecutive).
        send_k, send_v, first_block = k, v, len(owned_prefix)
        if self.shard is not None:  # this rank's complete blocks only
            owned = self._owned_blocks(prefix_blocks, tokens // BLOCK_TOKENS)
            token_ids = (owned.to(k.device).unsqueeze(1) - prefix_blocks) * BLOCK_TOKENS
            token_ids = token_ids + torch.arange(BLOCK_TOKENS, device=k.device)
            send_k, send_v = (x.index_select(1, token_ids.view(-1)) for x in (k, v))
        copied = self._kernels.offload(
            send_k.contiguous(), send_v.contiguous(), self.host_arena, row, first_block=first_block
        )
        self._remember(copied)
        closed = tokens // BLOCK_TOKENS * BLOCK_TOKENS
        open_tokens = tokens - closed
        self.tail[:, row].zero_()
        if open_tokens:
            self.tail[:, row, 0, 0, :open_tokens] = k[:, closed - first :]
            self.tail[:, row, 0, 1, :open_tokens] = v[:, closed - first :]
        self._lengths[row] = tokens
        self._states[row] = RowState.ACTIVE
        return copied

    def export_prefix(self, row: int, blocks: int) -> torch.Tensor:
        """The records of a row's first ``blocks`` complete blocks, for a host prefix cache.

        Returns:
            ``[L, blocks, 2, 4, Hkv, D]`` contiguous host tensor (a copy; written back blocks only,
            so ``4 × blocks`` must not exceed the row's closed tokens).
        """
        self._check_row(row)
        self._refuse_shard("export_prefix")
        if self.geometry.per_head:
            msg = "export_prefix returns every head's records; this store keeps one per head"
            raise KernelInputError(msg)
        closed_blocks = self._lengths[row] // BLOCK_TOKENS
        if not 0 < blocks <= closed_blocks:
            msg = (
                f"blocks={blocks!r} is not allowed for row {row!r}; allowed: 1..{closed_blocks!r} "
                "(its complete blocks)"
            )
            raise KernelInputError(msg)
        self.wait_for_host_writes()
        if self.device.type == "cuda":  # the host reads the arena: device writes must be done
            torch.cuda.current_stream(self.device).synchronize()
        return self.host_arena[row, :, :blocks].contiguous()

    def compare(self, row: int, k: torch.Tensor, v: torch.Tensor) -> KVComparison:
        """Compare what row ``row`` holds (arena blocks and tail) with its K/V, byte for byte.

        A diagnostic (it synchronises with the device and reads the arena on the host): ``k`` and
        ``v`` are the K/V a resident cache would hold for the row's tokens, e.g. a shadow copy
        kept by a caller that checks the offload. Under a shard group the row's own blocks and the
        tail are compared (and counted).

        Args:
            row: an active row.
            k: ``[L, T, Hkv, D]`` keys of the row's ``T = length(row)`` tokens, the geometry's
                dtype, any device.
            v: the values, shaped like ``k``.
        """
        self._check_active([row])
        g = self.geometry
        tokens = self._lengths[row]
        expected = (g.layers, tokens, g.kv_heads, g.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected or k.dtype != g.dtype:
            msg = (
                f"k and v must be {expected!r} {g.dtype}; got {tuple(k.shape)!r} "
                f"{k.dtype} and {tuple(v.shape)!r}"
            )
            raise KernelInputError(msg)
        self.wait_for_host_writes()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        k, v = self._record_layers(k), self._record_layers(v)
        blocks, open_tokens = divmod(tokens, BLOCK_TOKENS)
        closed = blocks * BLOCK_TOKENS
        shape = (g.store_layers, blocks, BLOCK_TOKENS, g.record_heads, g.head_dim)
        want = torch.stack((k[:, :closed].reshape(shape), v[:, :closed].reshape(shape)), dim=2)
        owned = self._owned_blocks(0, blocks)
        if self.shard is not None:
            want = want[:, owned.to(want.device)]
        have = self.host_arena[row, :, : len(owned)]
        tail = self.tail[:, row, 0, :, :open_tokens]  # [Ls, 2, open, Hr, D]
        want_tail = torch.stack((k[:, closed:], v[:, closed:]), dim=1)
        differing = _differing_bytes(have, want) + _differing_bytes(tail, want_tail)
        compared = (len(owned) * BLOCK_TOKENS + open_tokens) * g.store_layers
        return KVComparison(compared * g.record_bytes // BLOCK_TOKENS, differing)

    def state(self, row: int) -> RowState:
        """Whether row ``row`` holds a request (its occupancy, not a lease state)."""
        return self._states[self._check_row(row)]

    def release(self, row: int) -> None:
        """Free a row; its arena bytes are left as they are and overwritten by the next admit."""
        self._check_row(row)
        self._states[row] = RowState.FREE
        self._lengths[row] = 0
        if row in self._plan.rows:
            self._planned = False
            self._plan.clear()

    # -- one decode step --

    def begin_step(self) -> int:
        """Start a decode step; returns its number (``0, 1, ...``).

        Hot-cache stamps come from a device counter that every fetch advances, so they grow with
        every step and every layer, and a captured step replays without a host value.
        """
        self._step += 1
        return self._step

    def advance(self, rows: Sequence[int], *, pad_to: int | None = None) -> tuple[int, ...]:
        """Count one new token in each row and plan the step on the device.

        :meth:`write_token` then stores the token, layer by layer, and :meth:`attend` reads it.
        Every row is checked before anything changes. A row whose new token opens a block gets a
        clean tail record in every layer.

        Args:
            rows: ``B`` distinct active rows, each with room for one more token.
            pad_to: the batch a captured CUDA graph was recorded for (``>= B``); free rows fill
                the step up to it. Their token writes land in their own free tails, they close no
                block and select none, so they change nothing a request reads.

        Returns:
            The step's rows, padding last: what :meth:`write_token` and :meth:`attend` take.
        """
        g = self.geometry
        self._check_active(rows)
        positions = [self._lengths[row] for row in rows]
        for row, position in zip(rows, positions, strict=True):
            if position >= g.max_tokens:
                msg = f"row {row!r} is full ({g.max_tokens!r} tokens)"
                raise KernelInputError(msg)
        padding = self._padding_rows(len(rows), pad_to)
        self.wait_for_host_writes()  # a prompt may still be on its way to host
        fresh = [
            row
            for row, position in zip(rows, positions, strict=True)
            if position % BLOCK_TOKENS == 0
        ]
        if fresh:
            self.tail[:, torch.tensor(fresh, device=self.device)] = 0
        for row, position in zip(rows, positions, strict=True):
            self._lengths[row] = position + 1
        step_rows = (*rows, *padding)
        lengths = [position + 1 for position in positions] + [1] * len(padding)
        self._plan.load(step_rows, lengths, len(rows))
        self._planned = True
        return step_rows

    @property
    def step_closed_blocks(self) -> torch.Tensor:
        """``[B]`` int32 device: each planned row's complete blocks, the new token included.

        A selection entry at or beyond it is not a complete block; padding rows hold 0. Valid
        from :meth:`advance` to the step's end, at a fixed address (CUDA-graph safe).
        """
        return self._plan.closed_blocks

    @property
    def step_row_ids(self) -> torch.Tensor:
        """``[B]`` int32 device: the planned rows, padding last (fixed address)."""
        return self._plan.row_ids

    @property
    def step_positions(self) -> torch.Tensor:
        """``[B]`` int32 device: each planned row's new token position (padding: 0; fixed)."""
        return self._plan.positions

    @property
    def step_lengths(self) -> torch.Tensor:
        """``[B]`` int32 device: each planned row's length after its new token (padding: 1).

        :attr:`step_positions` plus one: a new tensor each call (one device op, no host read).
        """
        return self._plan.positions + 1

    def write_token(
        self, layer: int | None, rows: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store the token counted by the last :meth:`advance`; write back a block it closes.

        Args:
            layer: QSA layer index in ``[0, L)``, or ``None`` for every layer at once.
            rows: the rows of the last :meth:`advance`, in the same order.
            k: ``[B, Hkv, D]`` the token's keys in ``layer`` (``[L, B, Hkv, D]`` for every layer),
                the geometry's dtype.
            v: the token's values, shaped like ``k``.
        """
        g = self.geometry
        self._check_planned("write_token", rows)
        if layer is not None and not 0 <= layer < g.layers:
            msg = f"layer={layer!r} is not allowed; allowed: [0, {g.layers}) or None"
            raise KernelInputError(msg)
        per_layer = (len(rows), g.kv_heads, g.head_dim)
        expected = per_layer if layer is not None else (g.layers, *per_layer)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            msg = f"k and v must be {expected!r}; got {tuple(k.shape)!r} and {tuple(v.shape)!r}"
            raise KernelInputError(msg)
        if layer is not None:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        k, v = self._record_layers(k), self._record_layers(v)  # [n, B, Hr, D]
        span = slice(None) if layer is None else self._record_span(layer)
        plan = self._plan
        target = self.tail[span]
        target[:, plan.row_ids, 0, 0, plan.offsets] = k.to(g.dtype)
        target[:, plan.row_ids, 0, 1, plan.offsets] = v.to(g.dtype)
        # Every row's entry is launched; those whose token closes no block are masked (-1).
        n, spanned = plan.batch, int(k.shape[0])
        rows_t, blocks_t = plan.row_ids, plan.closing
        if spanned > 1:
            rows_t, blocks_t = rows_t.repeat(spanned), blocks_t.repeat(spanned)
        layers_t = self._layer_of[span, :n].contiguous().view(-1)  # the kernel reads dense
        self._kernels.writeback(
            self.tail,
            self.host_arena,
            rows=rows_t,
            layers=layers_t,
            slots=self._zero_slots[: rows_t.numel()],
            blocks=blocks_t,
            **self._current_stream(),
        )

    def append(self, rows: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one token per row to every layer; a block that closes is written back to host.

        Args:
            rows: ``B`` distinct active rows.
            k: ``[L, B, Hkv, D]`` the new token's keys in every QSA layer.
            v: ``[L, B, Hkv, D]`` its values.
        """
        g = self.geometry
        expected = (g.layers, len(rows), g.kv_heads, g.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            msg = f"k and v must be {expected!r}; got {tuple(k.shape)!r} and {tuple(v.shape)!r}"
            raise KernelInputError(msg)
        self.write_token(None, self.advance(rows), k, v)

    def attend(
        self,
        layer: int,
        rows: Sequence[int],
        q: torch.Tensor,
        blocks: torch.Tensor,
        *,
        scale: float | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer for ``B`` rows over their selected blocks and their open block.

        Under a shard group, over the selected blocks this rank stores (and the open block on
        rank 0): this rank's partial, ``(0, -inf)`` where it holds none of a row's tokens; ask
        for ``out_dtype=torch.float32`` to merge the partials without a bf16 rounding.

        Args:
            layer: QSA layer index in ``[0, L)``.
            rows: the step's rows (what the last :meth:`advance` returned).
            q: ``[B, Hq, D]`` bf16 queries.
            blocks: ``[B, K]`` int32 selected complete blocks (``-1`` padding), ``K <= S``; a
                padding row's entries must be ``-1`` (see :attr:`step_closed_blocks`).
            scale: softmax scale, ``1 / sqrt(D)`` if ``None``.
            out_dtype: dtype of ``out``: bf16, or fp32 for a later merge.

        Returns:
            ``(out [B, Hq, D] out_dtype, lse [B, Hq] fp32)``, the attention over the selected
            blocks' tokens and the row's open-block tokens, natural-log LSE.
        """
        self._check_step("attend", layer, rows)
        if self.geometry.per_head:
            msg = "attend takes blocks for every KV head; with per-head records use attend_tokens"
            raise KernelInputError(msg)
        if blocks.dim() != 2 or blocks.shape[0] != len(rows):
            msg = f"blocks must be [B={len(rows)}, K]; got {tuple(blocks.shape)!r}"
            raise KernelInputError(msg)
        blocks = blocks.to(torch.int32)
        if self.shard is not None:
            blocks = localize_blocks(blocks, self.shard.placement, self.shard.rank)
        slots = self._fetch(slice(layer, layer + 1), blocks.unsqueeze(1))[:, 0]
        hot_tokens = torch.where(
            slots.unsqueeze(-1) >= 0, slots.unsqueeze(-1) * BLOCK_TOKENS + self._block_offsets, -1
        ).reshape(len(rows), -1)
        tail = self._plan.tail_tokens if self._attends_tail else self._no_tail[: len(rows)]
        return self._attend_parts(layer, q, hot_tokens, tail, scale, out_dtype=out_dtype)

    def selection_counts(
        self, layer: int, rows: Sequence[int], blocks: torch.Tensor
    ) -> torch.Tensor:
        """How many selected blocks this rank stores, and how many of them miss the hot cache.

        Call it before :meth:`attend` or :meth:`attend_tokens`, which fetch the misses. Under a
        shard group, the blocks of other ranks are not counted (a group's counts add up to the
        selection). No host synchronisation.

        Args:
            layer: layer index in ``[0, L)``.
            rows: the step's rows (what the last :meth:`advance` returned).
            blocks: ``[B, K]`` int32 selected complete blocks of those rows, ``-1`` padded
                (what :meth:`attend` takes), or with per-head records ``[B, Hkv, K]`` (what
                :meth:`token_blocks` returns).

        Returns:
            ``[2]`` int64 device: (selected, missing) records.
        """
        self._check_step("selection_counts", layer, rows)
        g = self.geometry
        shape = (len(rows), g.kv_heads) if g.per_head else (len(rows),)
        if blocks.dim() != len(shape) + 1 or tuple(blocks.shape[:-1]) != shape:
            names = "B, Hkv, K" if g.per_head else "B, K"
            msg = f"blocks must be [{names}] with B={len(rows)}; got {tuple(blocks.shape)!r}"
            raise KernelInputError(msg)
        if self.shard is not None:
            blocks = localize_blocks(blocks, self.shard.placement, self.shard.rank)
        valid = blocks >= 0
        row_ids = self._plan.row_ids.long().view(-1, *[1] * (blocks.dim() - 1))
        ids = blocks.clamp(min=0).long()
        if g.per_head:
            table = self.tables.block_slot[self._record_span(layer)]  # [Hkv, R, NB]
            resident = table[self._head_ids.view(1, -1, 1), row_ids, ids] >= 0
        else:
            resident = self.tables.block_slot[layer][row_ids, ids] >= 0
        return torch.stack((valid.sum(), (valid & ~resident).sum()))

    def token_blocks(
        self, rows: Sequence[int], positions: torch.Tensor, *, checked: bool = True
    ) -> torch.Tensor:
        """The complete blocks that hold each KV head's chosen tokens (per-head records).

        What :meth:`attend_tokens` fetches: a head's chosen token needs that head's record of
        its 4-token block in the hot cache; tokens of the open block are read from the tail. No
        host synchronisation when ``W <= hot_slots`` or ``checked=False``; otherwise a wider
        list is counted on the host (one read) to refuse a head that needs more blocks than a
        hot cache holds.

        Args:
            rows: the step's rows (what the last :meth:`advance` returned).
            positions: ``[B, Hkv, W]`` int32 logical token positions each (row, KV head)
                attends, ``-1`` padded, each below the row's length after the step's token.
            checked: count a wide list's blocks on the host. ``False`` (a CUDA-graph step) when
                the caller guarantees at most ``hot_slots`` blocks per head, e.g. by sizing hot
                caches with :meth:`DSConfig.hot_blocks`; a head's blocks past ``hot_slots`` are
                then dropped.

        Returns:
            ``[B, Hkv, K]`` int32 distinct block ids per (row, head), ascending, ``-1`` padded,
            ``K = min(W, hot_slots)``.

        Raises:
            KernelInputError: the store keeps every head in one record, ``positions`` is not
                ``[B, Hkv, W]``, or a head needs more blocks than a hot cache holds.
        """
        g = self.geometry
        self._refuse_shard("token_blocks")
        self._require_per_head("token_blocks")
        self._check_planned("token_blocks", rows)
        if positions.dim() != 3 or tuple(positions.shape[:2]) != (len(rows), g.kv_heads):
            msg = (
                f"positions must be [B={len(rows)}, Hkv={g.kv_heads}, W]; got "
                f"{tuple(positions.shape)!r}"
            )
            raise KernelInputError(msg)
        sentinel = g.max_blocks  # sorts after every block id
        in_hot = self._in_closed_blocks(positions)
        ids = torch.where(in_hot, positions // BLOCK_TOKENS, sentinel).sort(dim=2).values
        repeat = torch.zeros_like(ids, dtype=torch.bool)
        repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
        ids = torch.where(repeat, sentinel, ids).sort(dim=2).values
        width = int(positions.shape[2])
        if checked and width > g.hot_slots:
            need = int((ids < sentinel).sum(dim=2).max())  # the host read
            if need > g.hot_slots:
                msg = (
                    f"a KV head needs {need!r} distinct blocks in one hot cache but hot_slots="
                    f"{g.hot_slots!r}; allowed: at most hot_slots blocks per row, layer and head"
                )
                raise KernelInputError(msg)
        ids = ids[..., : min(width, g.hot_slots)]
        return torch.where(ids < sentinel, ids, -1).to(torch.int32)

    def attend_tokens(
        self,
        layer: int,
        rows: Sequence[int],
        q: torch.Tensor,
        positions: torch.Tensor,
        blocks: torch.Tensor,
        *,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer for ``B`` rows over chosen tokens, a list per KV head.

        :meth:`attend` takes whole blocks for every head (QSA's indexer); this takes tokens per
        KV head (double sparsity's heavy tokens) from a store of per-head records: each head's
        blocks are fetched into that head's hot cache (one fetch for every head of the layer),
        each head attends only its own tokens there and in the open-block tail, and the two
        parts are merged by their LSE. No host synchronisation.

        Args:
            layer: layer index in ``[0, L)``.
            rows: the step's rows (what the last :meth:`advance` returned).
            q: ``[B, Hq, D]`` bf16 queries.
            positions: ``[B, Hkv, W]`` int32 chosen token positions, ``-1`` padded (see
                :meth:`token_blocks`).
            blocks: ``token_blocks(rows, positions)``.
            scale: softmax scale, ``1 / sqrt(D)`` if ``None``.

        Returns:
            ``(out [B, Hq, D] bf16, lse [B, Hq] fp32)``, natural-log LSE.
        """
        g = self.geometry
        self._refuse_shard("attend_tokens")
        self._require_per_head("attend_tokens")
        self._check_step("attend_tokens", layer, rows)
        batch = len(rows)
        if (
            blocks.dim() != 3
            or tuple(blocks.shape[:2]) != (batch, g.kv_heads)
            or blocks.shape[2] > g.hot_slots
        ):
            msg = (
                f"blocks must be [B={batch}, Hkv={g.kv_heads}, K <= hot_slots={g.hot_slots}] "
                f"(token_blocks); got {tuple(blocks.shape)!r}"
            )
            raise KernelInputError(msg)
        span = self._record_span(layer)
        plan = self._plan
        row_t = plan.row_ids.long().view(batch, 1, 1)
        if blocks.shape[2]:
            self._fetch(span, blocks)
        # Token ids into a head's records viewed as token rows (_head_records).
        in_hot = self._in_closed_blocks(positions)
        block = torch.where(in_hot, positions // BLOCK_TOKENS, 0).long()
        table = self.tables.block_slot[span]  # [Hkv, R, NB]
        slot = table[self._head_ids.view(1, -1, 1), row_t, block]
        token = (row_t * g.hot_slots + slot) * _RECORD_ROWS + positions % BLOCK_TOKENS
        hot_tokens = torch.where(in_hot, token, -1).to(torch.int32).contiguous()
        # The open block's tokens each head chose, as tail token ids.
        offsets = self._block_offsets[: BLOCK_TOKENS - 1]
        closed = plan.closed_blocks.view(batch, 1, 1, 1) * BLOCK_TOKENS
        chosen = (positions.unsqueeze(-1) == closed + offsets).any(dim=2)  # [B, Hkv, 3]
        tail_ids = (row_t * _RECORD_ROWS + offsets).expand_as(chosen)
        tail_tokens = torch.where(chosen, tail_ids, -1).to(torch.int32).contiguous()
        parts = [
            self._kernels.decode_split(
                q, tokens, *_head_records(cache[span]), scale=scale, out_dtype=torch.float32
            )
            for tokens, cache in ((hot_tokens, self.hot), (tail_tokens, self.tail))
        ]
        return self._kernels.merge(
            torch.stack([out for out, _ in parts]), torch.stack([lse for _, lse in parts])
        )

    def wait_for_host_writes(self) -> None:
        """Order the current stream after every write to the host arena or tail still in flight.

        Call it before reading the arena from the device by other means (e.g. a fetch issued by
        a caller); :meth:`advance` and :meth:`attend` call it themselves. It does not block the
        host.
        """
        if self._pending:
            stream = torch.cuda.current_stream(self.device)
            for event in self._pending:
                stream.wait_event(event)
            self._pending.clear()

    # -- internals --

    def _record_layers(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, T, Hkv, D]`` K or V of ``n`` layers as their record layers.

        ``[n Hkv / Hr, T, Hr, D]``: a copy with per-head records, ``x`` itself otherwise.
        """
        if not self.geometry.per_head:
            return x
        n, t, hkv, d = x.shape
        return x.permute(0, 2, 1, 3).reshape(n * hkv, t, 1, d)

    def _require_per_head(self, call: str) -> None:
        if not self.geometry.per_head:
            msg = (
                f"{call} reads each KV head's own tokens; it needs per-head records "
                "(OffloadGeometry(per_head=True))"
            )
            raise KernelInputError(msg)

    def _record_span(self, layer: int) -> slice:
        """The record layers of logical layer ``layer``."""
        per_layer = self.geometry.store_layers // self.geometry.layers
        return slice(layer * per_layer, (layer + 1) * per_layer)

    def _owned_blocks(self, start: int, stop: int) -> torch.Tensor:
        """``[n]`` int64 (CPU): the blocks of ``[start, stop)`` this rank's arena stores."""
        ids = torch.arange(start, stop, dtype=torch.int64)
        if self.shard is None:
            return ids
        return ids[localize_blocks(ids, self.shard.placement, self.shard.rank) >= 0]

    def _refuse_shard(self, call: str) -> None:
        if self.shard is not None:
            msg = (
                f"{call} reads every block of a row; under a shard group of "
                f"{self.shard.world_size!r} ranks this rank stores only its own"
            )
            raise KernelInputError(msg)

    def _check_row(self, row: int) -> int:
        given: object = row
        if (
            not isinstance(given, int)
            or isinstance(given, bool)
            or not 0 <= row < self.geometry.rows
        ):
            msg = f"row={row!r} is not allowed; allowed: [0, {self.geometry.rows})"
            raise KernelInputError(msg)
        return row

    def _check_active(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._check_row(row)
        if len(set(rows)) != len(rows):
            msg = f"rows {list(rows)!r} repeat a row; each row may appear once per call"
            raise KernelInputError(msg)
        for row in rows:
            if self._states[row] is not RowState.ACTIVE:
                msg = f"row {row!r} is {self._states[row].value!r}; it must be active"
                raise KernelInputError(msg)

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
                f"{len(free)} of {self.geometry.rows} are free"
            )
            raise KernelInputError(msg)
        return free[: pad_to - real]

    def _in_closed_blocks(self, positions: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, W]`` bool: which chosen positions lie in a planned row's complete blocks."""
        closed = self._plan.closed_blocks.view(-1, 1, 1) * BLOCK_TOKENS
        return (positions >= 0) & (positions < closed)

    def _check_step(self, call: str, layer: int, rows: Sequence[int]) -> None:
        """An attention call of one layer needs a stamped step planned for ``rows``."""
        if not 0 <= layer < self.geometry.layers:
            msg = f"layer={layer!r} is not allowed; allowed: [0, {self.geometry.layers})"
            raise KernelInputError(msg)
        if self._step < 0:
            msg = f"{call} before begin_step(); every decode step needs a stamp"
            raise KernelInputError(msg)
        self._check_planned(call, rows)

    def _fetch(self, layers: slice, blocks: torch.Tensor) -> torch.Tensor:
        """Make the planned rows' ``[B, NL, K]`` int32 blocks of record layers ``layers`` resident.

        Returns their ``[B, NL, K]`` global hot slots. Write-backs still in flight land first.
        """
        self.wait_for_host_writes()
        return self._kernels.fetch(
            blocks.contiguous(),
            self._plan.row_ids,
            self._layer_ids[layers],
            step=self._stamp,
            tables=self.tables,
            hot=self.hot,
            host_arena=self.host_arena,
        )

    def _attend_parts(
        self,
        layer: int,
        q: torch.Tensor,
        hot_tokens: torch.Tensor,
        tail_tokens: torch.Tensor,
        scale: float | None,
        *,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over hot-cache tokens and tail-record tokens of one layer, LSE-merged.

        Both parts stay fp32 until the merge, so the output is rounded (to ``out_dtype``) once.
        """
        g = self.geometry
        out_hot, lse_hot = self._kernels.decode(
            q,
            hot_tokens,
            self.hot[layer].view(g.rows * g.hot_slots, *g.record_shape),
            scale=scale,
            out_dtype=torch.float32,
        )
        out_tail, lse_tail = self._kernels.decode(
            q,
            tail_tokens,
            self.tail[layer].view(g.rows, *g.record_shape),
            scale=scale,
            out_dtype=torch.float32,
        )
        return self._kernels.merge(
            torch.stack((out_hot, out_tail)),
            torch.stack((lse_hot, lse_tail)),
            out_dtype=out_dtype,
        )

    def _check_planned(self, call: str, rows: Sequence[int]) -> None:
        if not self._planned or self._plan.rows != tuple(rows):
            have = list(self._plan.rows) if self._planned else None
            msg = f"{call} for rows {list(rows)!r}; the last advance() counted rows {have!r}"
            raise KernelInputError(msg)

    def _current_stream(self) -> dict[str, torch.cuda.Stream]:
        """Keyword arguments that put a write-back on the current stream (CUDA) or inline."""
        if self.path is KernelPath.TRITON and self.device.type == "cuda":
            return {"stream": torch.cuda.current_stream(self.device)}
        return {}

    def _remember(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self._pending.append(event)
