"""One rank's request offload: request leases and their rows, a prompt's staging, the decode step.

:class:`OffloadRuntime` is what an engine's attention backend calls; it knows nothing of the
engine. Each running request holds one lease of the runtime's :class:`qsa_core.LeaseTable`
(:attr:`OffloadRuntime.leases`), acquired by the engine with its own index of the request (its
*engine slot*, SGLang's ``req_pool_idx``); the lease's slot is the request's row of the store
(:class:`OffloadedKV` or :class:`PerHeadOffloadedKV`). The lease is the request's one identity and
its state is true:

- **Prefill** (PREFILLING). Each chunk's K/V is written to the prompt's area of the GPU staging
  area (:meth:`stage`), which the engine's prefill kernels read as the prompt's context. The
  staging area holds :attr:`OffloadGeometry.staged_prompts` prompts at once (one per request of an
  engine's prefill batch), each in an area of its own; a restored prefix fills its area first
  (:meth:`stage_prefix`, by copies a layer's first reader waits for, :meth:`fill_staging_until`).
  With :attr:`OffloadGeometry.windowed_staging` (DS-Offload's default) the area holds one prompt
  by a window of layers instead (:class:`~qsa_kernels.offload._window.StagingWindow`): each
  layer's chunk is written through to the prompt's arena row as it is staged, and a layer's
  prefix is read back from there before its chunk, so the engine's kernels read the same bytes.
- **Hand-off** (COPYING_TO_HOST, then HOST_READY). A staged prompt goes to its row (complete
  blocks to the host arena on a side stream, the open block to the tail) when its first decode
  step is planned or when another prompt needs its area, whichever comes first; the
  lease is HOST_READY once the runtime sees the copy complete (it looks at every planned step,
  without waiting; decode steps queued before then run after the copy in stream order).
- **Decode** (DECODING from the first step planned once the host holds the prompt). Each step is
  planned outside any CUDA graph (:meth:`plan_decode`: the hand-off,
  the rows, the store's fixed step buffers); each layer's :meth:`decode_layer` (the QSA indexer's
  blocks) or :meth:`decode_tokens` (tokens chosen per KV head) then reads only those buffers, so
  it can be captured once per batch size and replayed.
- **Release** (DRAINING, RELEASED). :meth:`release` waits for a hand-off copy still in flight,
  frees the row and ends the lease, when the request gives its engine slot back.

Under a shard group (``kv.shard``) each rank's arena holds its own pages and a decode layer
all-gathers the group's queries, attends every head of the group over the rank's own blocks and
merges the owners' fp32 partials (:func:`qsa_kernels.sharded.gather_group_queries`,
:func:`qsa_kernels.sharded.merge_owner_partials`).

With ``verify`` the runtime also keeps a resident copy of every token's K/V on the device and,
when a row is released, compares the host arena and tail with it byte for byte.

The runtime counts what it does (:class:`OffloadCounts`: rows in use, decode steps, blocks
selected and fetched, bytes verified) and hands every change to ``on_counts``, so an engine can
export the numbers its own way. The block counters live on the device and are read every
:data:`LOG_EVERY_STEPS` steps and when a row is released: the decode path never synchronizes for
them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol

import torch

from qsa_core import CountSeries, LeaseHandle, LeaseState, LeaseTable, format_bytes
from qsa_kernels._errors import KernelInputError, QSAKernelError
from qsa_kernels.context import PrefillKernels, ZigzagEntries, attend_chunks, attend_context
from qsa_kernels.expand import complete_blocks
from qsa_kernels.offload._block_store import OffloadedKV
from qsa_kernels.offload._head_store import PerHeadOffloadedKV
from qsa_kernels.offload._plan import RowState
from qsa_kernels.offload._store import OffloadGeometry
from qsa_kernels.offload._window import StagingWindow
from qsa_kernels.sharded import (
    HeadLayout,
    ShardedDecodeBuffers,
    ShardedIndex,
    ShardGroup,
    gather_group_queries,
    merge_owner_partials,
)

__all__ = (
    "LOG_EVERY_STEPS",
    "CopyFence",
    "OffloadCounts",
    "OffloadRuntime",
    "OffloadStateError",
)

logger = logging.getLogger(__name__)

#: Decode steps between two log lines (and two reads of the device-side block counters).
LOG_EVERY_STEPS: Final = 256


class OffloadStateError(QSAKernelError, RuntimeError):
    """A call the runtime's rows do not allow.

    For example an engine slot without a lease, a row whose length disagrees with the engine's, or a
    prompt the staging area does not hold. The message names the slot, row and token counts
    involved.
    """


class CopyFence(Protocol):
    """Copies in flight on another stream (e.g. ``qsa_hostcache.CopyFence``)."""

    def wait(self) -> None:
        """Order the current stream's later work after the copies."""


@dataclasses.dataclass(slots=True)
class _StagedPrompt:
    """One prompt in the staging area: its area, the tokens staged, whether it is all there.

    ``whole``: the tokens its prefill writes, when the engine told them at admission; the prompt
    is written once its last layer has staged that many (or the engine says so,
    :meth:`OffloadRuntime.prompt_written`).
    """

    area: int
    whole: int | None = None
    tokens: int = 0
    written: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadCounts:
    """What one runtime has done since it was built.

    Attributes:
        rows_in_use: rows held by a live lease now.
        decode_steps: decode steps planned (captures excluded).
        selected_blocks: complete blocks the decode layers selected, all layers, as of the last
            read of the device counters.
        fetched_blocks: selected blocks that missed the hot cache and were read from the host
            arena, as of the same read.
        verified_bytes: K/V bytes of released rows compared with their resident copy.
        differing_bytes: compared bytes that differed (0 unless the offload lost a byte).
        staged_peak: most prompts staged at once (at most
            :attr:`OffloadGeometry.staged_prompts`).
    """

    rows_in_use: int = 0
    decode_steps: int = 0
    selected_blocks: int = 0
    fetched_blocks: int = 0
    verified_bytes: int = 0
    differing_bytes: int = 0
    staged_peak: int = 0

    @staticmethod
    def series() -> tuple[CountSeries, ...]:
        """Every field as a metric, in declaration order: its name, kind and help text."""
        return _SERIES


_SERIES: Final = (
    CountSeries(
        "rows_in_use", "offload_rows_in_use", False, "Host arena rows that hold a request's K/V."
    ),
    CountSeries(
        "decode_steps",
        "offload_decode_steps",
        True,
        "Decode steps served from the host arena.",
    ),
    CountSeries(
        "selected_blocks",
        "selected_blocks",
        True,
        "Complete blocks the indexer selected, all layers.",
    ),
    CountSeries(
        "fetched_blocks",
        "fetched_blocks",
        True,
        "Selected blocks that missed the hot cache and were read from the host arena.",
    ),
    CountSeries(
        "verified_bytes",
        "offload_verified_bytes",
        True,
        "K/V bytes of released rows compared with their resident copy (verification on).",
    ),
    CountSeries(
        "differing_bytes",
        "offload_differing_bytes",
        True,
        "Compared K/V bytes that differed from their resident copy (verification on).",
    ),
    CountSeries(
        "staged_peak",
        "offload_staged_prompts_peak",
        False,
        "Most prompts staged on the GPU at once (at most --prefill-max-requests).",
    ),
)


class OffloadRuntime:
    """The offloaded K/V of one rank and the leases of the requests whose rows it holds.

    Args:
        kv: the rows, hot caches, tails and host arena: records of every KV head (QSA's
            blocks), or per-head records (tokens chosen per KV head).
        layer_ordinal: the engine's layer id of each offloaded layer -> its index in ``kv``
            (``[0, L)``).
        block_topk: width of the QSA indexer's block selection (512 for Qwen3.8-Flash-Next);
            None where tokens are chosen per KV head instead (double sparsity).
        verify: keep a resident copy of every row's K/V and compare the row with it on release.
        q_heads: query heads of this rank's attention layers; with a shard group in ``kv``
            (``kv.shard``), the transport buffers are sized for the group's heads.
        head_layout: how the shard group holds its query heads: SHARDED (the TP head split,
            ``N x q_heads`` in the group) or REPLICATED (CP over the TP group: every rank all
            ``q_heads``).
        on_counts: called with the runtime's :class:`OffloadCounts` whenever they change.
        leases: the requests' leases, one slot per row of ``kv`` (default: a table of its own);
            the engine acquires each request's lease there, with its engine slot.

    Raises:
        OffloadStateError: a shard group without ``q_heads`` or ``block_topk``, a shard group
            with a windowed staging area, or ``leases`` whose slots are not the store's rows.
    """

    def __init__(
        self,
        kv: OffloadedKV | PerHeadOffloadedKV,
        layer_ordinal: Mapping[int, int],
        block_topk: int | None,
        *,
        verify: bool = False,
        q_heads: int | None = None,
        head_layout: HeadLayout = HeadLayout.SHARDED,
        on_counts: Callable[[OffloadCounts], None] | None = None,
        leases: LeaseTable | None = None,
    ) -> None:
        self.kv = kv
        g = kv.geometry
        if leases is not None and leases.num_slots != g.rows:
            msg = f"a lease table of {leases.num_slots!r} slots for a store of {g.rows!r} rows"
            raise OffloadStateError(msg)
        self.leases = LeaseTable(g.rows) if leases is None else leases
        self._exchange: ShardedDecodeBuffers | None = None
        if kv.shard is not None:
            if q_heads is None or block_topk is None:
                msg = "a sharded offload needs the rank's query heads and the QSA block top-k"
                raise OffloadStateError(msg)
            self._exchange = ShardedDecodeBuffers.for_rank(
                kv.shard.world_size,
                head_layout,
                max_rows=g.rows,
                block_topk=block_topk,
                q_heads=q_heads,
                head_dim=g.head_dim,
                device=kv.device,
            )
        # Prompts' K/V of every offloaded layer, by area and token position: [L, P, T_max, Hkv, D]
        # (windowed: the layer being staged alone, [1, 1, T_max, Hkv, D]).
        self._window: StagingWindow | None = None
        if g.windowed_staging:
            if kv.shard is not None:
                msg = "a windowed staging area writes whole rows; got a shard group"
                raise OffloadStateError(msg)
            self._window = StagingWindow(kv)
        staged_layers = 1 if g.windowed_staging else g.layers
        shape = (staged_layers, g.staged_prompts, g.max_tokens, g.kv_heads, g.head_dim)
        self.staging_k = torch.zeros(shape, dtype=g.dtype, device=kv.device)
        self.staging_v = torch.zeros(shape, dtype=g.dtype, device=kv.device)
        # The leases whose prompts are staged, oldest first.
        self._staged: dict[LeaseHandle, _StagedPrompt] = {}
        # The tokens each admitted lease's prefill writes, until its prompt claims an area.
        self._prompt_tokens: dict[LeaseHandle, int] = {}
        # Reads a staged prompt before it leaves the staging area (read_before_hand_off).
        self._hand_off_reader: Callable[[LeaseHandle, int], None] | None = None
        # Hand-off copies not yet seen complete, by lease (``None``: completed synchronously).
        self._copies: dict[LeaseHandle, torch.cuda.Event] = {}
        # Copies still reading the staged prompt (checkpoints on their way to the host).
        self._staging_readers: list[CopyFence] = []
        # Copies still writing a staged layer (a restored prefix on its way in), by ordinal.
        self._staging_fills: dict[int, CopyFence] = {}
        # The resident copy for verification: [R, L, T_max, Hkv, D] K and V, or None.
        self._resident: tuple[torch.Tensor, torch.Tensor] | None = None
        if verify:
            rows_shape = (g.rows, g.layers, g.max_tokens, g.kv_heads, g.head_dim)
            self._resident = (
                torch.zeros(rows_shape, dtype=g.dtype, device=kv.device),
                torch.zeros(rows_shape, dtype=g.dtype, device=kv.device),
            )
        self._ordinal = dict(layer_ordinal)
        self._block_topk = block_topk
        self._rows: tuple[int, ...] = ()  # the planned step's rows, padding last
        self._pending_counts = torch.zeros(2, dtype=torch.int64, device=kv.device)
        self._counts = OffloadCounts()
        self._on_counts = on_counts
        self._report()

    @classmethod
    def for_geometry(
        cls,
        geometry: OffloadGeometry,
        device: torch.device,
        layer_ordinal: Mapping[int, int],
        block_topk: int | None,
        *,
        shard: ShardGroup | None = None,
        verify: bool = False,
        q_heads: int | None = None,
        head_layout: HeadLayout = HeadLayout.SHARDED,
        on_counts: Callable[[OffloadCounts], None] | None = None,
    ) -> OffloadRuntime:
        """A runtime over a new store of ``geometry`` on ``device``.

        Per-head records (:attr:`OffloadGeometry.per_head`) get a :class:`PerHeadOffloadedKV`,
        records of every KV head an :class:`OffloadedKV` (under ``shard``, if given); the other
        arguments are the constructor's.

        Raises:
            KernelInputError: a shard group for per-head records (they are not sharded).
        """
        if geometry.per_head and shard is not None:
            msg = "per-head records are not sharded; got a shard group for them"
            raise KernelInputError(msg)
        kv = (
            PerHeadOffloadedKV(geometry, device)
            if geometry.per_head
            else OffloadedKV(geometry, device, shard=shard)
        )
        return cls(
            kv,
            layer_ordinal,
            block_topk,
            verify=verify,
            q_heads=q_heads,
            head_layout=head_layout,
            on_counts=on_counts,
        )

    @staticmethod
    def fixed_device_bytes(geometry: OffloadGeometry, *, verify: bool = False) -> int:
        """Device bytes a runtime of ``geometry`` allocates once (staging, hot caches, tails).

        The staging area holds one prompt of every layer (windowed: two layers of one prompt and
        the open blocks); with ``verify``, the resident copy of
        every row too (the arena's size, on the device):
        :meth:`qsa_core.OffloadSizes.fixed_device_bytes`.
        """
        return geometry.sizes.fixed_device_bytes(verify=verify)

    def describe(self) -> str:
        """One line of what the runtime holds, for an engine's start-up log.

        The host arena (rows, layers, blocks, record layout, dtype, pinned or pageable) and the
        device's fixed buffers: staging, hot caches, tails and tables.
        """
        g, kv = self.kv.geometry, self.kv
        return (
            f"host arena {format_bytes(g.arena_bytes(kv.shard))} ({g.rows} rows x {g.layers} "
            f"attention layers x {g.arena_blocks(kv.shard)} blocks, "
            f"{'per-head' if g.per_head else 'all-head'} records, "
            f"{str(g.dtype).removeprefix('torch.')}, "
            f"{'pinned' if kv.host_arena.is_pinned() else 'pageable'}); on {kv.device}: staging, "
            f"hot caches ({g.hot_slots} blocks per request, layer and "
            f"{'KV head' if g.per_head else 'every KV head'}), tails and tables "
            f"{format_bytes(self.fixed_device_bytes(g))}"
        )

    def describe_sharding(self) -> str | None:
        """One line of the arena's share under a shard group (None without one)."""
        shard, g = self.kv.shard, self.kv.geometry
        if shard is None:
            return None
        return (
            f"cache sharding over {shard.world_size} ranks (this rank is {shard.rank} of its "
            f"group): the host arena holds every {shard.world_size}-th page of "
            f"{shard.placement.blocks_per_page} blocks, {format_bytes(g.arena_bytes(shard))} of "
            f"{format_bytes(g.host_bytes)} per rank"
        )

    def index(self) -> ShardedIndex:
        """The compressed index's shard operations on this runtime's shard group (D2).

        On the group, device and path of the arena's shards, ``block_topk`` wide; the candidate
        buffers hold a decode row of every arena row or one prefill group
        (:meth:`ShardedIndex.rows_for`).

        Raises:
            OffloadStateError: a runtime without a shard group (an unsharded arena, or
                per-head records), or without the QSA block top-k.
        """
        shard = self.kv.shard if isinstance(self.kv, OffloadedKV) else None
        if shard is None or self._block_topk is None:
            msg = (
                "the index is sharded over the host arenas' shard group; this runtime has "
                f"shard={shard!r} and block_topk={self._block_topk!r}"
            )
            raise OffloadStateError(msg)
        return ShardedIndex(
            shard,
            block_topk=self._block_topk,
            max_rows=ShardedIndex.rows_for(self.kv.geometry.rows),
            device=self.kv.device,
            path=self.kv.path,
        )

    def describe_verification(self) -> str | None:
        """One line of what verification keeps, for an engine's start-up log (None: off)."""
        if self._resident is None:
            return None
        return (
            f"a resident copy of every row's K/V ({format_bytes(self.kv.geometry.host_bytes)}) is "
            f"kept on {self.kv.device} and checked against the host arena when each request ends"
        )

    @property
    def host_arena_bytes(self) -> int:
        """Bytes of this rank's host arena."""
        return int(self.kv.host_arena.nbytes)

    @property
    def rows_in_use(self) -> int:
        """Rows held by a live lease."""
        return self.leases.num_slots - self.leases.num_free

    @property
    def counts(self) -> OffloadCounts:
        """What the runtime has done so far (block counters as of their last read)."""
        return self._counts

    # ---- the request lifecycle -------------------------------------------------------------------

    def admit(
        self, request_id: str, engine_slot: int, prompt_tokens: int | None = None
    ) -> LeaseHandle:
        """A request starts its prefill: its lease (PREFILLING), whose slot is its row.

        ``prompt_tokens``: the tokens its prefill writes (its prompt; a retracted request's
        earlier output too), if the engine knows them now. The prompt is then staged whole when
        :meth:`stage` has written that many, in the forward itself: an engine that processes a
        batch's result only after it has launched the next batch (SGLang's overlap scheduling)
        calls :meth:`prompt_written` too late for the next batch's prompts to claim an area.

        Raises:
            qsa_core.LeaseError: no free row, or ``request_id`` or ``engine_slot`` already holds
                a live lease (the message names the holder).
        """
        handle = self.leases.admit(request_id, engine_slot)
        if prompt_tokens is not None:
            self._prompt_tokens[handle] = prompt_tokens
        self._count(rows_in_use=self.rows_in_use)
        return handle

    def prompt_written(self, handle: LeaseHandle, tokens: int, prompt_tokens: int) -> None:
        """``tokens`` of the prompt are staged: nothing moves yet.

        The lease stays PREFILLING until its first decode step is planned (or another prompt
        needs its staging area, once all ``prompt_tokens`` are staged), which hands the prompt
        off. The same call as :meth:`qsa_core.ResidentRows.prompt_written`, so an engine's
        lifecycle is one path.
        """
        staged = self._staged.get(handle)
        if staged is not None and tokens >= prompt_tokens:
            staged.written = True

    def release(self, handle: LeaseHandle, *, aborted: bool = False) -> None:
        """The request gave its engine slot back (finish, abort, retraction): end its lease.

        A hand-off copy still in flight is waited for (HOST_READY), the lease drains and is
        released, then the row is compared with its resident copy (verification) and freed.

        Raises:
            qsa_core.LeaseError: ``handle`` is not a live lease of :attr:`leases`, or it never
                prefilled and ``aborted`` is False (nothing changes).
        """
        event = self._copies.pop(handle, None)
        if event is not None:
            event.synchronize()  # ended within its prompt's copy: rare, and bounded by the copy
            self.leases.finish_copy(handle)
        self._staged.pop(handle, None)
        self._prompt_tokens.pop(handle, None)
        self.leases.end(handle, aborted=aborted)
        self._count(rows_in_use=self.rows_in_use)  # before the verification's counts
        row = handle.slot
        if self.kv.state(row) is RowState.ACTIVE:
            if self._resident is not None:
                self._verify(row)
            self.kv.release(row)
        self.flush_counters()  # once per request: the one device read outside the log interval

    # ---- prefill: the staging area ---------------------------------------------------------------

    @property
    def staged(self) -> dict[int, int]:
        """The rows whose prompts are in the staging area -> tokens staged, oldest first."""
        return {handle.slot: staged.tokens for handle, staged in self._staged.items()}

    def stage(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, *, slot: int, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's prefill chunk, tokens ``[start, end)`` of ``slot``'s prompt.

        Args:
            layer_id: the engine's layer id.
            k: ``[N, Hkv * D]`` (or ``[N, Hkv, D]``, ``N >= end - start``) keys of the chunk.
            v: its values, shaped like ``k``.
            slot: the prefilling request's engine slot.
            start: tokens of the prompt before the chunk (all already staged).
            end: the chunk's end.

        Returns:
            ``(k [end, Hkv, D], v [end, Hkv, D])``: the staged prompt up to the chunk's end, in
            the geometry's dtype.

        Raises:
            OffloadStateError: ``slot`` holds no lease, its lease is past its prefill, the prompt
                outgrows its staging area, tokens before ``start`` are not staged, or every area
                holds a prompt still prefilling.
        """
        ordinal = self._ordinal_of(layer_id)
        handle = self._prefilling(slot)
        row = handle.slot
        g = self.kv.geometry
        if end > g.max_tokens:
            msg = f"a prompt of {end!r} tokens exceeds the staging area ({g.max_tokens!r})"
            raise OffloadStateError(msg)
        staged = self._staged.get(handle)
        if staged is None:
            staged = self._claim_staging(handle)
        self._filled(ordinal)
        if start > staged.tokens:
            msg = (
                f"row {row!r} prefills tokens [{start!r}, {end!r}) but the staging area holds "
                f"only its first {staged.tokens!r}"
            )
            raise OffloadStateError(msg)
        n, area, window = end - start, staged.area, self._window
        staged_k, staged_v = self._staging(ordinal, area)
        if window is not None:
            window.restore(ordinal, row, start, staged_k, staged_v)
        staged_k[start:end] = k[:n].reshape(n, g.kv_heads, g.head_dim)
        staged_v[start:end] = v[:n].reshape(n, g.kv_heads, g.head_dim)
        staged.tokens = end
        if staged.whole is not None and end >= staged.whole and ordinal == g.layers - 1:
            staged.written = True  # its last layer: another prompt may now hand it off
        if window is not None:
            following = ordinal + 1 if ordinal + 1 < g.layers else None
            window.write_through(ordinal, row, start, end, staged_k, staged_v, following)
            if self._resident is not None:
                self._resident[0][row, ordinal, start:end] = staged_k[start:end]
                self._resident[1][row, ordinal, start:end] = staged_v[start:end]
        return staged_k[:end], staged_v[:end]

    def prefill(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        indices: torch.Tensor,
        *,
        slot: int,
        start: int,
        end: int,
        scale: float,
        kernels: PrefillKernels,
        zigzag: ZigzagEntries | None = None,
    ) -> torch.Tensor:
        """Stage one layer's chunk (:meth:`stage`) and attend its query rows over the prompt.

        A whole prompt in one chunk attends over the chunk itself with the no-prefix kernel on
        CUDA (:func:`~qsa_kernels.context.attend_chunks`); otherwise the rows attend over the
        staging area (:func:`~qsa_kernels.context.attend_context`), under context parallelism
        as this rank's ``zigzag`` entries of a chunk every rank stages whole.

        Args:
            layer_id: the engine's layer id.
            q: ``[T, Hq, D]`` the chunk's query rows (this rank's zigzag rows with ``zigzag``).
            k: ``[N, Hkv * D]`` (or ``[N, Hkv, D]``) keys of the chunk, ``N >= end - start``.
            v: its values, shaped like ``k``.
            indices: ``[T, W]`` the indexer's token positions per row, ``-1`` padded.
            slot: the prefilling request's engine slot.
            start: tokens of the prompt before the chunk.
            end: the chunk's end.
            scale: softmax scale.
            kernels: the engine's prefill kernels.
            zigzag: this rank's zigzag entries of the chunk, or None.

        Returns:
            ``[T, Hq, D]`` in ``q``'s dtype.

        Raises:
            OffloadStateError: as :meth:`stage`.
        """
        staged_k, staged_v = self.stage(layer_id, k, v, slot=slot, start=start, end=end)
        if zigzag is None and start == 0 and q.is_cuda:  # the whole prompt: the no-prefix kernel
            return attend_chunks(q, k, v, indices, [int(q.shape[0])], scale, kernels)
        return attend_context(q, staged_k, staged_v, indices, scale, kernels, zigzag=zigzag)

    def extend(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        indices: torch.Tensor,
        *,
        slots: Sequence[int],
        extend_lens: Sequence[int],
        seq_lens: Sequence[int],
        scale: float,
        kernels: PrefillKernels,
        zigzag: ZigzagEntries | None = None,
    ) -> torch.Tensor:
        """One layer of an extend batch: each request's chunk through :meth:`prefill`, in order.

        Under context parallelism (``zigzag``) the batch is one request whose chunk every rank
        stages whole, and ``q`` / ``indices`` are this rank's zigzag rows.

        Args:
            layer_id: the engine's layer id.
            q: ``[T, Hq, D]`` the batch's query rows, packed request by request.
            k: ``[T, Hkv * D]`` (or ``[T, Hkv, D]``) the chunks' keys, packed alike.
            v: their values, shaped like ``k``.
            indices: ``[T, W]`` the indexer's token positions per row, ``-1`` padded.
            slots: each request's engine slot.
            extend_lens: each request's chunk tokens (summing to ``T``).
            seq_lens: each request's length with its chunk.
            scale: softmax scale.
            kernels: the engine's prefill kernels.
            zigzag: this rank's zigzag entries of a one-request batch, or None.

        Returns:
            ``[T, Hq, D]`` in ``q``'s dtype.

        Raises:
            OffloadStateError: as :meth:`stage`, for any request.
            KernelInputError: ``zigzag`` with a batch of other than one request.
        """
        if zigzag is not None:
            if len(extend_lens) != 1:
                requests = len(extend_lens)
                msg = f"zigzag entries with an extend batch of {requests!r} requests; allowed: 1"
                raise KernelInputError(msg)
            end = int(seq_lens[0])
            return self.prefill(
                layer_id,
                q,
                k,
                v,
                indices,
                slot=int(slots[0]),
                start=end - int(extend_lens[0]),
                end=end,
                scale=scale,
                kernels=kernels,
                zigzag=zigzag,
            )
        outs, offset = [], 0
        for slot, count, end in zip(slots, extend_lens, seq_lens, strict=True):
            rows = slice(offset, offset + int(count))
            outs.append(
                self.prefill(
                    layer_id,
                    q[rows],
                    k[rows],
                    v[rows],
                    indices[rows],
                    slot=int(slot),
                    start=int(end) - int(count),
                    end=int(end),
                    scale=scale,
                    kernels=kernels,
                )
            )
            offset += int(count)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def staged_layers(self, row: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, ``[tokens, Hkv, D]`` views of ``row``'s first ``tokens`` staged tokens.

        Views, not copies: a reader that outlives the current stream's work registers its copies
        with :meth:`keep_staging_until`.

        Raises:
            OffloadStateError: the staging area does not hold ``tokens`` tokens of ``row`` (a
                windowed one holds no prompt of every layer).
        """
        self._refuse_window("staged_layers")
        staged = next((s for h, s in self._staged.items() if h.slot == row), None)
        if staged is None or not 0 < tokens <= staged.tokens:
            msg = (
                f"row {row!r} asks for {tokens!r} staged tokens; the staging area holds "
                f"{self.staged!r} (row -> tokens)"
            )
            raise OffloadStateError(msg)
        self._filled()
        return self._layer_views(staged.area, tokens)

    def staging_layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole staging area of one layer: ``[P × T_max, Hkv, D]`` K and V.

        Row ``a × T_max + t`` holds token ``t`` of the prompt staged in area ``a`` (area 0 alone
        with one staged prompt): what a dense prefill kernel reads as its K/V pool. Windowed,
        every layer's is the one layer staged last (the layer :meth:`stage` just wrote).
        """
        ordinal = self._ordinal_of(layer_id)
        self._filled(ordinal)
        g = self.kv.geometry
        flat = (-1, g.kv_heads, g.head_dim)
        index = self._staged_index(ordinal)
        return self.staging_k[index].view(flat), self.staging_v[index].view(flat)

    def stage_prefix(self, row: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Give the staging area to ``row``, whose first ``tokens`` tokens come from elsewhere.

        For a prefix restored from a host prefix cache: the caller fills the returned views (as
        :meth:`staged_layers`) before the row's first prefill chunk runs, on the current stream
        or by copies it names per layer with :meth:`fill_staging_until`.

        Raises:
            OffloadStateError: the prefix does not fit the staging area, ``row`` is not the
                row of a prefilling lease, every area holds a prompt still prefilling, or the
                staging area is windowed (it holds no prompt of every layer).
        """
        self._refuse_window("stage_prefix")
        g = self.kv.geometry
        if not 0 < tokens <= g.max_tokens:
            msg = (
                f"a restored prefix of {tokens!r} tokens; the staging area holds 1 to "
                f"{g.max_tokens!r}"
            )
            raise OffloadStateError(msg)
        handle = next((h for h in self.leases.live_handles() if h.slot == row), None)
        if handle is None or self.leases.state(handle) is not LeaseState.PREFILLING:
            msg = f"row {row!r} restores a prefix but holds no prefilling lease ({handle!r})"
            raise OffloadStateError(msg)
        staged = self._staged.get(handle) or self._claim_staging(handle)
        staged.tokens = tokens
        return self._layer_views(staged.area, tokens)

    def read_before_hand_off(self, reader: Callable[[LeaseHandle, int], None] | None) -> None:
        """Call ``reader(handle, tokens)`` as each staged prompt is handed off, before it leaves.

        The prompt is still staged during the call (:meth:`staged_layers` reads it; copies that
        outlive the call register with :meth:`keep_staging_until`), and the hand-off happens in
        the step that first decodes it or in the prefill that needs its area: before that step's
        kernels, so what the engine keeps alongside the prompt (a recurrent state) is still the
        prompt's own. An engine whose checkpoint of a prompt's end comes later (an overlapped
        scheduler processes a batch's result after it launched the next one) takes it here.
        """
        self._hand_off_reader = reader

    def keep_staging_until(self, fence: CopyFence) -> None:
        """Copies reading the staging area until ``fence``: the next prompt waits for them."""
        self._staging_readers.append(fence)

    def fill_staging_until(self, ordinal: int, fence: CopyFence) -> None:
        """Copies write layer ``ordinal``'s staged prefix until ``fence``.

        The first reader of that layer orders the current stream after them, so a restore's
        copies overlap the model's layers before it instead of holding up the whole step.
        """
        self._staging_fills[ordinal] = fence

    # ---- decode ----------------------------------------------------------------------------------

    def plan_decode(
        self,
        slots: Sequence[int],
        seq_lens: Sequence[int],
        *,
        pad_to: int | None = None,
        capture: bool = False,
    ) -> None:
        """Plan one decode step: hand off a prompt that starts decoding, then the step's rows.

        A lease still PREFILLING hands its prompt off (COPYING_TO_HOST); hand-off copies seen
        complete make their leases HOST_READY, and a HOST_READY lease in the step DECODING.

        Args:
            slots: the step's requests, by engine slot (none while a CUDA graph is captured).
            seq_lens: each request's length with the token this step adds.
            pad_to: the batch size of a captured CUDA graph the step replays (or is captured
                as): free rows pad the step to it, their work masked.
            capture: the step is being captured; it is not counted.

        Raises:
            OffloadStateError: a slot holds no lease, a row's length is not its request's, or the
                store refuses the plan (naming why).
        """
        self._poll_copies()
        rows = []
        for slot, seq_len in zip(slots, seq_lens, strict=True):
            handle = self.leases.at_engine_slot(slot)
            if handle is None:
                msg = f"request slot {slot!r} decodes but holds no lease"
                raise OffloadStateError(msg)
            row = handle.slot
            held = seq_len - 1  # every token before the one this step adds
            if self.leases.state(handle) is LeaseState.PREFILLING:
                self._hand_off(handle, held)
            elif self.kv.length(row) != held:
                msg = (
                    f"row {row!r} (request slot {slot!r}) holds {self.kv.length(row)!r} tokens; "
                    f"the engine decodes token {held!r}"
                )
                raise OffloadStateError(msg)
            if self.leases.state(handle) is LeaseState.HOST_READY:
                self.leases.begin_decode(handle)
            rows.append(row)
        try:
            self._rows = self.kv.advance(rows, pad_to=pad_to)
        except KernelInputError as exc:
            raise OffloadStateError(f"cannot plan the decode step: {exc}") from exc
        self.kv.begin_step()
        if not capture:
            steps = self._counts.decode_steps + 1
            self._count(decode_steps=steps)
            if steps % LOG_EVERY_STEPS == 0:
                self.flush_counters(log=True)

    def decode_layer(  # noqa: PLR0917 (the attention call's own order)
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        indices: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One QSA layer of the planned decode step.

        Args:
            layer_id: the engine's layer id.
            q: ``[B, Hq * D]`` (or ``[B, Hq, D]``) bf16 queries.
            k: ``[B, Hkv * D]`` the new token's keys.
            v: ``[B, Hkv * D]`` its values.
            indices: the indexer's selection (the forms :func:`complete_blocks` takes).
            scale: softmax scale.

        Returns:
            ``[B, Hq * D]`` attention output, in ``q``'s dtype.
        """
        if self._block_topk is None or not isinstance(self.kv, OffloadedKV):  # before the token
            msg = "decode_layer takes a QSA indexer's blocks; this runtime chooses tokens"
            raise OffloadStateError(msg)
        ordinal = self._append(layer_id, k, v)
        # Padding rows have 0 complete blocks: nothing selected.
        blocks = complete_blocks(indices, self.kv.step_closed_blocks, self._block_topk)
        rows = self._rows
        q = q.reshape(len(rows), -1, self.kv.geometry.head_dim)
        shard, exchange = self.kv.shard, self._exchange
        if shard is None or exchange is None:
            out, _lse = self.kv.attend(
                ordinal, rows, q, blocks, scale=scale, counters=self._pending_counts
            )
        else:  # every head of the group over this rank's blocks, then each rank its own heads
            group_q = gather_group_queries(q.to(torch.bfloat16), shard=shard, buffers=exchange)
            part, lse = self.kv.attend(
                ordinal, rows, group_q, blocks, scale=scale, out_dtype=torch.float32,
                counters=self._pending_counts,
            )  # fmt: skip
            out, _lse = merge_owner_partials(
                part, lse, shard=shard, buffers=exchange, path=self.kv.path
            )
        return out.reshape(len(rows), -1).to(q.dtype)

    def decode_tokens(  # noqa: PLR0917 (decode_layer's order)
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        *,
        checked: bool = True,
    ) -> torch.Tensor:
        """One attention layer of the planned decode step over chosen tokens per KV head.

        Double sparsity's form of :meth:`decode_layer`: the new token goes to the tail (a block it
        closes to the host arena), then each KV head attends the tokens it chose, whose blocks
        are fetched into that head's hot cache (:meth:`PerHeadOffloadedKV.token_blocks`; no host
        read while the chosen lists fit a hot cache, or with ``checked=False``).

        Args:
            layer_id: the engine's layer id.
            q: ``[B, Hq * D]`` (or ``[B, Hq, D]``) bf16 queries.
            k: ``[B, Hkv * D]`` the new token's keys.
            v: ``[B, Hkv * D]`` its values.
            positions: ``[B, Hkv, W]`` int32 token positions each (row, KV head) attends, ``-1``
                padded, the new token's among them where chosen.
            scale: softmax scale.
            checked: refuse a head whose blocks overflow its hot cache (a host read for lists
                wider than the hot cache). ``False`` in a captured step whose hot caches hold as
                many slots as any list needs.

        Returns:
            ``[B, Hq * D]`` attention output, in ``q``'s dtype.
        """
        if not isinstance(self.kv, PerHeadOffloadedKV):  # refused before the token is written
            msg = "decode_tokens takes tokens chosen per KV head; this runtime's store reads blocks"
            raise OffloadStateError(msg)
        ordinal = self._append(layer_id, k, v)
        rows = self._rows
        try:
            blocks = self.kv.token_blocks(rows, positions, checked=checked)
        except KernelInputError as exc:
            raise OffloadStateError(f"layer {layer_id!r}: {exc}") from exc
        out, _lse = self.kv.attend_tokens(
            ordinal,
            rows,
            q.reshape(len(rows), -1, self.kv.geometry.head_dim),
            positions,
            blocks,
            scale=scale,
            counters=self._pending_counts,
        )
        return out.reshape(len(rows), -1).to(q.dtype)

    def flush_counters(self, *, log: bool = False) -> tuple[int, int]:
        """Read the device-side block counters into :attr:`counts`; returns (selected, fetched).

        Reads the device (one synchronization); the decode path calls it every
        :data:`LOG_EVERY_STEPS` steps, :meth:`release` once per request.
        """
        selected, fetched = (int(x) for x in self._pending_counts.tolist())
        self._pending_counts.zero_()
        if selected or fetched:
            self._count(
                selected_blocks=self._counts.selected_blocks + selected,
                fetched_blocks=self._counts.fetched_blocks + fetched,
            )
        if log:
            hit = 1.0 - fetched / selected if selected else 1.0
            logger.info(
                "offload: %d decode steps; last %d: %d blocks selected, %d fetched from host "
                "(hot-cache hit rate %.3f); %d rows in use; host arena %.1f GiB",
                self._counts.decode_steps,
                LOG_EVERY_STEPS,
                selected,
                fetched,
                hit,
                self.rows_in_use,
                self.host_arena_bytes / (1 << 30),
            )
        return selected, fetched

    # ---- internals -------------------------------------------------------------------------------

    def _append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write the step's new token of one layer (and a block it closes); its ordinal."""
        ordinal = self._ordinal_of(layer_id)
        g = self.kv.geometry
        batch = len(self._rows)  # padding included under a CUDA graph
        k = k.reshape(batch, g.kv_heads, g.head_dim)
        v = v.reshape(batch, g.kv_heads, g.head_dim)
        self.kv.write_token(ordinal, self._rows, k, v)
        if self._resident is not None:  # where a resident pool would have put the token
            rows, positions = self.kv.step_row_ids.long(), self.kv.step_positions.long()
            self._resident[0][rows, ordinal, positions] = k.to(g.dtype)
            self._resident[1][rows, ordinal, positions] = v.to(g.dtype)
        return ordinal

    def _ordinal_of(self, layer_id: int) -> int:
        ordinal = self._ordinal.get(layer_id)
        if ordinal is None:
            msg = f"layer {layer_id!r} is not offloaded; offloaded layers: {list(self._ordinal)!r}"
            raise OffloadStateError(msg)
        return ordinal

    def _staging(self, ordinal: int, area: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T_max, Hkv, D]`` K and V of one layer's area (windowed: the one staged layer)."""
        index = self._staged_index(ordinal)
        return self.staging_k[index, area], self.staging_v[index, area]

    def _staged_index(self, ordinal: int) -> int:
        """The staging area's layer that holds layer ``ordinal`` (windowed: the one layer)."""
        return 0 if self._window is not None else ordinal

    def _refuse_window(self, call: str) -> None:
        if self._window is not None:
            msg = (
                f"{call} reads every layer of a staged prompt; this staging area holds one prompt "
                "by a window of layers (windowed_staging)"
            )
            raise OffloadStateError(msg)

    def _layer_views(self, area: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        layers = range(self.kv.geometry.layers)
        return (
            [self.staging_k[i, area, :tokens] for i in layers],
            [self.staging_v[i, area, :tokens] for i in layers],
        )

    def _prefilling(self, slot: int) -> LeaseHandle:
        """The lease of engine slot ``slot``, which must be prefilling."""
        handle = self.leases.at_engine_slot(slot)
        if handle is None:
            msg = f"request slot {slot!r} prefills but holds no lease"
            raise OffloadStateError(msg)
        state = self.leases.state(handle)
        if state is not LeaseState.PREFILLING:
            msg = f"request slot {slot!r} prefills but its lease is {state.value!r} ({handle!r})"
            raise OffloadStateError(msg)
        return handle

    def _claim_staging(self, handle: LeaseHandle) -> _StagedPrompt:
        """Give ``handle`` a staging area: a free one, or one whose prompt it first hands off.

        The prompt handed off is the oldest one staged whole (:meth:`prompt_written`), else the
        oldest: with one area, the prompt before this one (an engine that prefills one prompt at
        a time has finished it).

        Raises:
            OffloadStateError: every area holds a prompt still prefilling (more prompts in one
                prefill batch than :attr:`OffloadGeometry.staged_prompts`).
        """
        areas = self.kv.geometry.staged_prompts
        taken = {staged.area for staged in self._staged.values()}
        free = [area for area in range(areas) if area not in taken]
        if not free:
            whole = [h for h, staged in self._staged.items() if staged.written]
            if not whole and areas > 1:
                msg = (
                    f"row {handle.slot!r} needs a staging area, but all {areas!r} hold prompts "
                    f"still prefilling (row -> tokens: {self.staged!r})"
                )
                raise OffloadStateError(msg)
            held = (whole or list(self._staged))[0]
            free = [self._staged[held].area]
            self._hand_off(held, self._staged[held].tokens)
        self._filled()  # the next prompt overwrites what they write and what the readers read
        for fence in self._staging_readers:
            fence.wait()
        self._staging_readers.clear()
        staged = _StagedPrompt(free[0], whole=self._prompt_tokens.pop(handle, None))
        self._staged[handle] = staged
        if len(self._staged) > self._counts.staged_peak:
            self._count(staged_peak=len(self._staged))
        return staged

    def _filled(self, ordinal: int | None = None) -> None:
        """Order the current stream after the copies filling one staged layer (None: all)."""
        if ordinal is None:
            fences = list(self._staging_fills.values())
            self._staging_fills.clear()
        else:
            fence = self._staging_fills.pop(ordinal, None)
            fences = [] if fence is None else [fence]
        for fence in fences:
            fence.wait()

    def _hand_off(self, handle: LeaseHandle, tokens: int) -> None:
        """The staged prompt of ``handle`` (its first ``tokens`` tokens) into its row.

        The lease is COPYING_TO_HOST until the copy is seen complete (at once when it ran
        synchronously).
        """
        row = handle.slot
        staged = self._staged.get(handle)
        if staged is None or staged.tokens != tokens:
            msg = (
                f"row {row!r} starts decoding after {tokens!r} tokens, but the staging area "
                f"holds {self.staged!r} (row -> tokens)"
            )
            raise OffloadStateError(msg)
        if self._hand_off_reader is not None:
            self._hand_off_reader(handle, tokens)
        self._filled()
        area = staged.area
        if self._window is not None:  # written through: the arena holds its complete blocks
            self._window.hand_off(row, tokens)
            copy = None
        else:
            k, v = self.staging_k[:, area, :tokens], self.staging_v[:, area, :tokens]
            copy = self.kv.admit(row, k, v)
            if self._resident is not None:
                self._resident[0][row, :, :tokens] = k
                self._resident[1][row, :, :tokens] = v
        self.leases.begin_copy(handle)
        if copy is None:
            self.leases.finish_copy(handle)
        else:
            self._copies[handle] = copy
        del self._staged[handle]
        logger.debug("offload: row %d took a %d-token prompt", row, tokens)

    def _poll_copies(self) -> None:
        """Leases whose hand-off copy has completed become HOST_READY (no waiting)."""
        for handle, event in list(self._copies.items()):
            if event.query():  # type: ignore[no-untyped-call]
                del self._copies[handle]
                self.leases.finish_copy(handle)

    def _verify(self, row: int) -> None:
        """Compare a row's arena and tail with its resident copy (one device sync, diagnostics)."""
        assert self._resident is not None
        tokens = self.kv.length(row)
        k, v = (t[row, :, :tokens] for t in self._resident)
        result = self.kv.compare(row, k, v)
        self._count(
            verified_bytes=self._counts.verified_bytes + result.bytes_compared,
            differing_bytes=self._counts.differing_bytes + result.bytes_differing,
        )
        if result.bytes_differing:
            logger.error(
                "offload: row %d: %d of %d K/V bytes on the host differ from the resident copy",
                row,
                result.bytes_differing,
                result.bytes_compared,
            )
        else:
            logger.info(
                "offload: row %d: %d tokens, %d K/V bytes on the host equal the resident copy",
                row,
                tokens,
                result.bytes_compared,
            )

    def _count(self, **changes: int) -> None:
        self._counts = dataclasses.replace(self._counts, **changes)
        self._report()

    def _report(self) -> None:
        if self._on_counts is not None:
            self._on_counts(self._counts)
