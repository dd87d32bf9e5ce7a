"""The offloaded K/V of one rank: the sizes, and the device data path both record layouts share.

Each request row keeps its whole raw K/V history in a pinned host arena (``host_arena``: the
request K/V arena, one fixed row per request; not qsa-hostcache's byte arena of prefix
checkpoints); the device holds, per (record layer, row), a hot cache of ``S`` block slots
governed by the ``qsa_core`` residency contract, plus the open (incomplete) block of the row. A
decode step of one layer fetches the selected blocks that miss, attends over them in the hot
cache and over the open block in the tail, and merges the two parts by their LSE.

The offload splits along the line vLLM's ``kv_offload`` draws between a manager and its workers:

- the planner (:class:`~qsa_kernels.offload._plan.RowPlanner`, host only): rows, their states
  and lengths, admission and release, the planned step in fixed device buffers, padding rows;
- the stores (workers), one per record layout, on the data path here (:class:`OffloadStore`:
  arena, hot caches, tails, residency tables, prompt offload, token writes and write-back of
  closed blocks, fetch, compare, the stream and event ordering):
  :class:`~qsa_kernels.offload.OffloadedKV` (``_block_store``) keeps one 4-token block of every
  KV head per record and attends QSA's block selection, under a shard group over the rank's own
  pages; :class:`~qsa_kernels.offload.PerHeadOffloadedKV` (``_head_store``) keeps one head per
  record (:attr:`OffloadGeometry.per_head`) and attends tokens chosen per KV head (double
  sparsity), so a head's choice moves only its own bytes.

A decode step is planned on the host into fixed device buffers: the step's rows, each new token's
tail offset, each row's complete blocks, the block a token closes, the open-block token ids.
Everything after the plan (token writes, the masked write-back of closed blocks, fetch, sparse
decode, merge) reads only those buffers and a device stamp counter, never a host value, so one
layer's step can be captured in a CUDA graph once per batch size and replayed: the plan pads the
batch with free rows, whose work is masked out.

Ordering across streams is explicit: a prompt is offloaded on a side stream, and the current
stream waits on that copy's event before the next step. Closed blocks are written back on the
current stream, in order. Nothing here allocates pinned memory after construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qsa_core import CapacityError, OffloadSizes, ds_offload_sizes, format_bytes, hot_cache_slots
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
from qsa_kernels.head_tokens import (
    head_blocks,
    head_blocks_reference,
    head_tokens,
    head_tokens_reference,
)
from qsa_kernels.lse_merge import lse_merge, lse_merge_reference
from qsa_kernels.offload._plan import RowPlanner, RowState
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

__all__ = ("KVComparison", "OffloadGeometry", "OffloadStore")


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
        staged_prompts: prompts the runtime's staging area holds at once ``P``, each of up to
            :attr:`max_tokens` (one per request of an engine's prefill batch).
        windowed_staging: the runtime's staging area holds a window of layers of one prompt,
            each chunk written through to the host arena and a layer's prefix read back from
            there (:attr:`qsa_core.OffloadSizes.windowed_staging`; ``P`` must be 1).
    """

    layers: int
    rows: int
    hot_slots: int
    max_blocks: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    per_head: bool = False
    staged_prompts: int = 1
    windowed_staging: bool = False
    _sizes: OffloadSizes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows: object = self.rows  # OffloadSizes allows none; a store holds one at least
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            msg = f"rows={rows!r} is not allowed; it must be a positive integer"
            raise KernelInputError(msg)
        hot: object = self.hot_slots
        if isinstance(hot, int) and hot > MAX_HOT_SLOTS:
            msg = f"hot_slots={self.hot_slots!r} is not allowed; allowed: 1 to {MAX_HOT_SLOTS!r}"
            raise KernelInputError(msg)
        if self.dtype not in KV_DTYPES:
            msg = f"dtype={self.dtype!r} is not allowed; allowed: {KV_DTYPES!r}"
            raise KernelInputError(msg)
        try:  # the sizes check every count and flag, in one place
            sizes = OffloadSizes(
                layers=self.layers,
                rows=self.rows,
                hot_slots=self.hot_slots,
                max_blocks=self.max_blocks,
                kv_heads=self.kv_heads,
                head_dim=self.head_dim,
                element_bytes=self.dtype.itemsize,
                per_head=self.per_head,
                block_tokens=BLOCK_TOKENS,
                staged_prompts=self.staged_prompts,
                windowed_staging=self.windowed_staging,
            )
        except CapacityError as exc:
            raise KernelInputError(str(exc)) from None
        object.__setattr__(self, "_sizes", sizes)  # once: decode layers read store_layers

    @classmethod
    def for_context(
        cls,
        *,
        layers: int,
        rows: int,
        context_len: int,
        hot_slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        per_head: bool = False,
        staged_prompts: int = 1,
        windowed_staging: bool = False,
    ) -> OffloadGeometry:
        """The arena, hot caches and tails of ``rows`` requests of up to ``context_len`` tokens.

        ``max_blocks`` is qsa-core's for that context (:meth:`qsa_core.OffloadSizes.for_context`);
        the other sizes are the fields'.

        Raises:
            KernelInputError: a size qsa-core or the geometry refuses (named).
        """
        try:
            sizes = OffloadSizes.for_context(
                layers=layers,
                rows=rows,
                context_len=context_len,
                hot_slots=hot_slots,
                kv_heads=kv_heads,
                head_dim=head_dim,
                element_bytes=dtype.itemsize,
                per_head=per_head,
                block_tokens=BLOCK_TOKENS,
                staged_prompts=staged_prompts,
                windowed_staging=windowed_staging,
            )
        except CapacityError as exc:
            raise KernelInputError(str(exc)) from exc
        return cls(
            layers=layers,
            rows=rows,
            hot_slots=hot_slots,
            max_blocks=sizes.max_blocks,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            per_head=per_head,
            staged_prompts=staged_prompts,
            windowed_staging=windowed_staging,
        )

    @classmethod
    def for_block_topk(
        cls,
        *,
        layers: int,
        rows: int,
        context_len: int,
        block_topk: int,
        hot_blocks: int | None,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        staged_prompts: int = 1,
    ) -> OffloadGeometry:
        """QSA's records (all heads a block) for an indexer that selects ``block_topk`` blocks.

        Each hot cache holds :func:`qsa_core.hot_cache_slots` of ``block_topk`` and
        ``hot_blocks`` (None: qsa-core's default) for ``context_len``; the rest is
        :meth:`for_context`'s.

        Raises:
            KernelInputError: a size qsa-core or the geometry refuses (named).
        """
        try:
            hot_slots = hot_cache_slots(block_topk, hot_blocks, context_len=context_len)
        except CapacityError as exc:
            raise KernelInputError(str(exc)) from exc
        return cls.for_context(
            layers=layers,
            rows=rows,
            context_len=context_len,
            hot_slots=hot_slots,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            staged_prompts=staged_prompts,
        )

    @classmethod
    def per_head_for_context(
        cls,
        *,
        layers: int,
        rows: int,
        context_len: int,
        hot_blocks: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        windowed_staging: bool = True,
    ) -> OffloadGeometry:
        """Per-head records (tokens chosen per KV head, double sparsity) for ``context_len``.

        Every layer ``layers`` keeps one record per (block, KV head), so a head's chosen token
        moves only that head's bytes; each head's hot cache holds the ``hot_blocks`` one step may
        read, at most a whole context (:func:`qsa_core.ds_offload_sizes`). One prompt is staged,
        by a window of layers unless ``windowed_staging`` is False.

        Raises:
            KernelInputError: a size qsa-core or the geometry refuses (named).
        """
        try:
            sizes = ds_offload_sizes(
                layers=layers,
                rows=rows,
                context_len=context_len,
                hot_blocks=hot_blocks,
                kv_heads=kv_heads,
                head_dim=head_dim,
                element_bytes=dtype.itemsize,
                windowed_staging=windowed_staging,
            )
        except CapacityError as exc:
            raise KernelInputError(str(exc)) from exc
        return cls.for_context(
            layers=layers,
            rows=rows,
            context_len=context_len,
            hot_slots=sizes.hot_slots,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            per_head=True,
            windowed_staging=windowed_staging,
        )

    def check_host_memory(self, available: int | None, shard: ShardGroup | None = None) -> None:
        """Refuse an arena larger than the host memory ``available`` (bytes; None: unknown).

        Raises:
            KernelInputError: :meth:`arena_bytes` of ``shard`` exceed ``available``; the
                message gives the arena's product of sizes.
        """
        arena = self.arena_bytes(shard)
        if available is not None and arena > available:
            msg = (
                f"the host arena needs {format_bytes(arena)} ({self.rows} rows x "
                f"{self.store_layers} record layers x {self.arena_blocks(shard)} blocks x "
                f"{self.record_bytes} B) but the host has {format_bytes(available)} available"
            )
            raise KernelInputError(msg)

    def pool_shortfall(self, pool_tokens: int, context_len: int) -> str | None:
        """Why an engine's K/V pool of ``pool_tokens`` serves fewer than :attr:`rows` at once.

        ``context_len`` is tokens of one request's context; the pool holds
        ``pool_tokens // context_len`` whole contexts. The staging area's fixed GPU bytes
        (:attr:`qsa_core.OffloadSizes.staging_bytes`, :attr:`staged_prompts` whole prompts) come
        out of the budget that sized the pool, so the message names them, and with more than one
        staged prompt what staging one prompt at a time (``--prefill-max-requests 1``) would free.

        Returns:
            None when the pool holds :attr:`rows` whole contexts; else the operator's message.
        """
        fit = pool_tokens // context_len
        if fit >= self.rows:
            return None
        staging, prompts = self.sizes.staging_bytes, self.staged_prompts
        message = (
            f"the K/V pool holds {pool_tokens} tokens, room for {fit} request(s) of the "
            f"{context_len}-token context at once, against {self.rows} request rows; the "
            f"staging area takes {format_bytes(staging)} of the GPU budget for {prompts} whole "
            "prompt(s)"
        )
        if prompts > 1:
            freed = format_bytes(staging - staging // prompts)
            message += f"; staging one at a time (--prefill-max-requests 1) would free {freed}"
        return message

    @property
    def sizes(self) -> OffloadSizes:
        """The same sizes for qsa-core's arithmetic (:class:`qsa_core.OffloadSizes`).

        Every byte count below is computed there, once: the engine's pool sizing and the
        capacity plan read the same figures.
        """
        return self._sizes

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
    head_blocks: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    head_tokens: Callable[..., tuple[torch.Tensor, torch.Tensor]]
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
        head_blocks=head_blocks,
        head_tokens=head_tokens,
        writeback=writeback_blocks,
        offload=lambda *args, **kwargs: offload_prompt(*args, **kwargs)[1],
    ),
    KernelPath.REFERENCE: _Kernels(
        fetch=fetch_selected_blocks_reference,
        decode=sparse_decode_reference,
        decode_split=sparse_decode_split_reference,
        merge=lse_merge_reference,
        head_blocks=head_blocks_reference,
        head_tokens=head_tokens_reference,
        writeback=_writeback_reference,
        offload=_offload_reference,
    ),
}


@dataclass(frozen=True, slots=True)
class KVComparison:
    """What :meth:`OffloadStore.compare` found.

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


class OffloadStore:
    """The data path of one rank's offloaded K/V that both record layouts share.

    Not built by itself: :class:`~qsa_kernels.offload.OffloadedKV` (records of every KV head)
    and :class:`~qsa_kernels.offload.PerHeadOffloadedKV` (one head per record) add each
    layout's admission and attention calls (see the module docstring).

    Shapes: host arena (``host_arena``, the request K/V arena) ``[R, Ls, NB, 2, 4, Hr, D]``
    (pinned where CUDA exists), hot cache ``[Ls, R, S, 2, 4, Hr, D]``, open-block tails ``[Ls, R,
    1, 2, 4, Hr, D]`` (device), residency tables :class:`~qsa_kernels.fetch.HotCacheTables`; ``Ls,
    Hr`` are ``L, Hkv``, or ``L × Hkv, 1`` with per-head records (:attr:`OffloadGeometry.per_head`).
    Every method takes and returns K/V by logical layer and head. Rows, their token counts and
    the planned step are the host-side :attr:`planner`'s.

    A decode step either appends every layer's token at once (:meth:`append`), or, as a model's
    forward pass produces them, counts the token once (:meth:`advance`) and then writes it layer
    by layer (:meth:`write_token`) just before that layer attends.

    ``path`` picks the implementation: the Triton kernels, or their torch references (same
    contract; what a CPU-only engine runs). :attr:`KernelPath.AUTO` takes Triton on CUDA.

    ``shard``: this rank's shard group (all-head records only); the arena is then
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
        self._pending: list[torch.cuda.Event] = []
        self._layer_ids = torch.arange(layers, dtype=torch.int32, device=self.device)
        self._block_offsets = torch.arange(BLOCK_TOKENS, dtype=torch.int32, device=self.device)
        # The write-back's fixed index vectors, sliced per call: every entry's source slot (the
        # tail record, 0) and each record layer's id repeated for every row ([Ls, R]).
        self._zero_slots = torch.zeros(layers * g.rows, dtype=torch.int32, device=self.device)
        self._layer_of = self._layer_ids.repeat_interleave(g.rows).view(layers, g.rows)
        # Hot-cache stamps: every fetch reads this counter and advances it by one, on the device.
        self._stamp = torch.zeros(1, dtype=torch.int64, device=self.device)
        #: The host side: rows, their states and lengths, the planned step and its buffers.
        self.planner = RowPlanner(g.rows, g.max_tokens, self.device, self.shard)

    # -- request lifecycle --

    def length(self, row: int) -> int:
        """Tokens row ``row`` holds."""
        return self.planner.length(row)

    def state(self, row: int) -> RowState:
        """Whether row ``row`` holds a request (its occupancy, not a lease state)."""
        return self.planner.state(row)

    def _admit(
        self, row: int, k: torch.Tensor, v: torch.Tensor, prefix: torch.Tensor | None
    ) -> torch.cuda.Event | None:
        """Take a prefilled prompt into a free row: complete blocks to host, the open block to tail.

        With ``prefix`` (records of every KV head: the all-head layout's), the prompt is
        ``prefix`` followed by ``k``/``v``: the prefix records go to the row's first arena
        blocks as they are, and only the new tokens are offloaded after them.

        Args:
            row: a free request row.
            k: ``[L, T, Hkv, D]`` keys of every layer for the tokens after the prefix (device,
                the geometry's dtype); ``T`` may be 0 only with a prefix.
            v: ``[L, T, Hkv, D]`` values.
            prefix: ``[L, P, 2, 4, Hkv, D]`` records of the first ``P`` complete blocks
                (``4 P`` tokens), any device, the geometry's dtype; ``None`` for no prefix.

        Returns:
            The event that completes the copy to the host (on a side stream), or None when the
            copy ran synchronously. Later steps of this store are ordered after it themselves.
        """
        self.planner.check_free(row)
        g = self.geometry
        expected = (g.layers, k.shape[1] if k.dim() == 4 else -1, g.kv_heads, g.head_dim)
        if k.dim() != 4 or tuple(k.shape) != expected or tuple(v.shape) != expected:
            msg = (
                f"k and v must be [L={g.layers}, T, Hkv={g.kv_heads}, D={g.head_dim}]; got "
                f"{tuple(k.shape)!r} and {tuple(v.shape)!r}"
            )
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
        self.planner.check_prompt(tokens)
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
        self.planner.admit(row, tokens)
        return copied

    def admit_written(self, row: int, tokens: int, open_records: torch.Tensor) -> None:
        """Take a prompt whose complete blocks the arena already holds into a free row.

        For a prompt written through while it was staged (:meth:`write_prompt_records`): only its
        open block moves, to the row's tail.

        Args:
            row: a free request row.
            tokens: the prompt's tokens.
            open_records: ``[Ls, 2, 4, Hr, D]`` the open block of every record layer (device,
                zeros past the prompt's end; not read when ``tokens`` fills its last block).
        """
        self.planner.check_free(row)
        self.planner.check_prompt(tokens)
        self.tables.reset_rows(torch.tensor([row], device=self.device))
        self.tail[:, row].zero_()
        if tokens % BLOCK_TOKENS:
            self.tail[:, row, 0] = open_records
        self.planner.admit(row, tokens)

    def prompt_records(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's tokens of whole blocks as its record layers' records.

        Args:
            k: ``[4 n, Hkv, D]`` keys, the geometry's dtype.
            v: their values, shaped like ``k``.

        Returns:
            ``[Ls / L, n, 2, 4, Hr, D]`` records (a new tensor on ``k``'s device).
        """
        g = self.geometry
        keys, values = self._record_layers(k[None]), self._record_layers(v[None])
        per_layer, tokens = int(keys.shape[0]), int(keys.shape[1])
        shape = (per_layer, tokens // BLOCK_TOKENS, BLOCK_TOKENS, g.record_heads, g.head_dim)
        return torch.stack((keys.reshape(shape), values.reshape(shape)), dim=2)

    @staticmethod
    def record_tokens(records: torch.Tensor, part: int) -> torch.Tensor:
        """:meth:`prompt_records`' inverse for K (``part`` 0) or V (1): ``[4 n, Hkv, D]``."""
        layers, blocks, _, tokens, heads, d = records.shape
        rows = records[:, :, part].reshape(layers, blocks * tokens, heads, d)
        return rows.permute(1, 0, 2, 3).reshape(blocks * tokens, layers * heads, d)

    def write_prompt_records(
        self, row: int, layer: int, records: torch.Tensor, first_block: int
    ) -> None:
        """Records of one layer of a prompt into ``row``'s arena, from block ``first_block``.

        On the current stream (CUDA: asynchronous copies into pinned memory, one per record
        layer); the row need not hold a request yet (:meth:`admit_written` takes it after).

        Args:
            row: the prompt's row.
            layer: the logical layer.
            records: ``[Ls / L, n, 2, 4, Hr, D]`` (:meth:`prompt_records`), the geometry's dtype.
            first_block: the arena block of the first record.
        """
        span, n = self._record_span(layer), int(records.shape[1])
        if not 0 <= first_block <= first_block + n <= self.geometry.max_blocks:
            msg = (
                f"blocks [{first_block!r}, {first_block + n!r}) of a row; allowed: within "
                f"[0, {self.geometry.max_blocks!r})"
            )
            raise KernelInputError(msg)
        for i, record_layer in enumerate(range(span.start, span.stop)):
            target = self.host_arena[row, record_layer, first_block : first_block + n]
            target.copy_(records[i], non_blocking=True)

    def read_prompt_records(self, row: int, layer: int, blocks: int, out: torch.Tensor) -> None:
        """The first ``blocks`` records of one layer of ``row``'s arena into ``out[:, :blocks]``.

        On the current stream (CUDA: asynchronous copies from pinned memory, one per record
        layer).

        Args:
            row: the prompt's row.
            layer: the logical layer.
            blocks: records to read, at most :attr:`OffloadGeometry.max_blocks`.
            out: ``[Ls / L, NB, 2, 4, Hr, D]`` on the device.
        """
        span = self._record_span(layer)
        for i, record_layer in enumerate(range(span.start, span.stop)):
            out[i, :blocks].copy_(self.host_arena[row, record_layer, :blocks], non_blocking=True)

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
        self.planner.check_active([row])
        g = self.geometry
        tokens = self.planner.length(row)
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

    def release(self, row: int) -> None:
        """Free a row; its arena bytes are left as they are and overwritten by the next admit."""
        self.planner.release(row)

    # -- one decode step --

    def begin_step(self) -> int:
        """Start a decode step; returns its number (``0, 1, ...``).

        Hot-cache stamps come from a device counter that every fetch advances, so they grow with
        every step and every layer, and a captured step replays without a host value.
        """
        return self.planner.begin_step()

    def advance(self, rows: Sequence[int], *, pad_to: int | None = None) -> tuple[int, ...]:
        """Count one new token in each row and plan the step on the device.

        :meth:`write_token` then stores the token, layer by layer, and the layout's attention
        call reads it. Every row is checked before anything changes. A row whose new token opens
        a block gets a clean tail record in every layer.

        Args:
            rows: ``B`` distinct active rows, each with room for one more token.
            pad_to: the batch a captured CUDA graph was recorded for (``>= B``); free rows fill
                the step up to it. Their token writes land in their own free tails, they close no
                block and select none, so they change nothing a request reads.

        Returns:
            The step's rows, padding last: what :meth:`write_token` and the attention calls take.
        """
        step = self.planner.check_advance(rows, pad_to)
        self.wait_for_host_writes()  # a prompt may still be on its way to host
        fresh = step.opening
        if fresh:
            self.tail[:, torch.tensor(fresh, device=self.device)] = 0
        return self.planner.advance(step)

    @property
    def step_closed_blocks(self) -> torch.Tensor:
        """``[B]`` int32 device: each planned row's complete blocks, the new token included.

        A selection entry at or beyond it is not a complete block; padding rows hold 0. Valid
        from :meth:`advance` to the step's end, at a fixed address (CUDA-graph safe).
        """
        return self.planner.plan.closed_blocks

    @property
    def step_row_ids(self) -> torch.Tensor:
        """``[B]`` int32 device: the planned rows, padding last (fixed address)."""
        return self.planner.plan.row_ids

    @property
    def step_positions(self) -> torch.Tensor:
        """``[B]`` int32 device: each planned row's new token position (padding: 0; fixed)."""
        return self.planner.plan.positions

    @property
    def step_lengths(self) -> torch.Tensor:
        """``[B]`` int32 device: each planned row's length after its new token (padding: 1).

        :attr:`step_positions` plus one: a new tensor each call (one device op, no host read).
        """
        return self.planner.plan.positions + 1

    def write_token(
        self, layer: int | None, rows: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store the token counted by the last :meth:`advance`; write back a block it closes.

        Args:
            layer: layer index in ``[0, L)``, or ``None`` for every layer at once.
            rows: the rows of the last :meth:`advance`, in the same order.
            k: ``[B, Hkv, D]`` the token's keys in ``layer`` (``[L, B, Hkv, D]`` for every layer),
                the geometry's dtype.
            v: the token's values, shaped like ``k``.
        """
        g = self.geometry
        self.planner.check_planned("write_token", rows)
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
        plan = self.planner.plan
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
            k: ``[L, B, Hkv, D]`` the new token's keys in every layer.
            v: ``[L, B, Hkv, D]`` its values.
        """
        g = self.geometry
        expected = (g.layers, len(rows), g.kv_heads, g.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            msg = f"k and v must be {expected!r}; got {tuple(k.shape)!r} and {tuple(v.shape)!r}"
            raise KernelInputError(msg)
        self.write_token(None, self.advance(rows), k, v)

    def wait_for_host_writes(self) -> None:
        """Order the current stream after every write to the host arena or tail still in flight.

        Call it before reading the arena from the device by other means (e.g. a fetch issued by
        a caller); :meth:`advance` and the attention calls call it themselves. It does not block
        the host.
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

    def _check_step(self, call: str, layer: int, rows: Sequence[int]) -> None:
        """An attention call of one layer needs a stamped step planned for ``rows``."""
        if not 0 <= layer < self.geometry.layers:
            msg = f"layer={layer!r} is not allowed; allowed: [0, {self.geometry.layers})"
            raise KernelInputError(msg)
        self.planner.check_step(call, rows)

    def _fetch(
        self, layers: slice, blocks: torch.Tensor, counters: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Make the planned rows' ``[B, NL, K]`` int32 blocks of record layers ``layers`` resident.

        Returns their ``[B, NL, K]`` global hot slots. Write-backs still in flight land first.
        ``counters`` (``[2]`` int64, device) gets the selected and missing records added.
        """
        self.wait_for_host_writes()
        return self._kernels.fetch(
            blocks.contiguous(),
            self.planner.plan.row_ids,
            self._layer_ids[layers],
            step=self._stamp,
            tables=self.tables,
            hot=self.hot,
            host_arena=self.host_arena,
            counters=counters,
        )

    def _current_stream(self) -> dict[str, torch.cuda.Stream]:
        """Keyword arguments that put a write-back on the current stream (CUDA) or inline."""
        if self.path is KernelPath.TRITON and self.device.type == "cuda":
            return {"stream": torch.cuda.current_stream(self.device)}
        return {}

    def _remember(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self._pending.append(event)
