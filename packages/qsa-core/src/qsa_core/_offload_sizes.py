"""The buffers of one rank's request offload, and what a token costs with each KV feature.

The one arithmetic of the offload's memory: the offload's store (``qsa_kernels.offload``)
computes its byte counts through :class:`OffloadSizes`, the engine's pool sizing charges them as
fixed overhead, and :func:`qsa_core.plan_capacity` prints them. A *record* is one block
(``block_tokens`` tokens, the QSA compress ratio: 4) of K and V of one *record layer*: every KV
head of one attention layer, or with ``per_head`` one KV head of one layer (double sparsity's
DS-Offload, where each KV head chooses its own tokens). With ``Ls`` record layers, ``R`` rows,
``S`` hot slots and ``NB`` blocks of a context, one rank allocates:

* staging (device): one prompt of every record layer, ``Ls × NB`` records; or, with
  ``windowed_staging`` (DS-Offload's default), a window of :data:`WINDOW_LAYERS` layers of one
  prompt (the layer being attended, in token order, and the next one's prefix fetched back from
  the host arena as records) and one open block of every record layer:
  ``2 × Ls / L × NB + Ls`` records;
* hot caches and tails (device): ``Ls × R × (S + 1)`` records (``S`` hot slots and one open-block
  tail per record layer and row);
* residency tables (device): ``Ls × R × (S × (4 + 8) + NB × 4)`` bytes (an int32 block id and an
  int64 stamp per slot, an int32 slot per block);
* verification (device, only when asked): a resident copy of every row, the arena's size;
* host arena (pinned host): ``R × Ls × NB`` records (under a shard group, the rank's own blocks).

Stdlib only; sizes in elements and bytes, no dtype objects: the caller passes the element size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from qsa_core._checks import is_int
from qsa_core._errors import CapacityError

__all__ = (
    "WINDOW_LAYERS",
    "OffloadSizes",
    "context_blocks",
    "ds_offload_sizes",
    "label_bytes_per_token",
    "sharded_token_bytes",
)

#: Tokens of one record block: the QSA compress ratio the offload's kernels are built for.
_BLOCK_TOKENS: Final = 4
#: Residency-table bytes per hot slot: an int32 block id and an int64 stamp.
_SLOT_TABLE_BYTES: Final = 4 + 8
#: Residency-table bytes per arena block: the int32 hot slot holding it (or -1).
_BLOCK_TABLE_BYTES: Final = 4
#: Layers of one prompt a windowed staging area holds: the layer being attended, and the next
#: one's prefix on its way back from the host arena.
WINDOW_LAYERS: Final = 2


def _positive(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        msg = f"{name}={value!r} is not allowed; it must be a positive integer"
        raise CapacityError(msg)


def _non_negative(name: str, value: object) -> None:
    if not is_int(value) or value < 0:
        msg = f"{name}={value!r} is not allowed; it must be an integer >= 0"
        raise CapacityError(msg)


def context_blocks(tokens: int, block_tokens: int = _BLOCK_TOKENS) -> int:
    """Blocks that hold ``tokens`` tokens (the last one may be open)."""
    return -(-tokens // block_tokens)


@dataclass(frozen=True, slots=True)
class OffloadSizes:
    """The sizes of one rank's request offload and the bytes of each buffer it allocates.

    Attributes:
        layers: offloaded attention layers ``L``.
        rows: request rows ``R`` (concurrent requests; 0 prices the staging area alone).
        hot_slots: hot-cache block slots ``S`` per (record layer, row).
        max_blocks: arena blocks ``NB`` per (row, layer): ``ceil(max_context / block_tokens)``.
        kv_heads: K/V heads per rank ``Hkv``.
        head_dim: ``D``.
        element_bytes: bytes of one K/V element (1 for FP8, 2 for bf16).
        per_head: one record per (block, KV head) instead of one per block of every KV head.
        block_tokens: tokens per block (4).
        staged_prompts: prompts the staging area holds at once ``P`` (an engine's prefill batch
            of up to ``P`` requests), each up to ``NB`` blocks.
        windowed_staging: the staging area holds :data:`WINDOW_LAYERS` layers of one prompt
            (each chunk written through to the host arena, a layer's prefix read back from
            there), not the prompt of every layer; ``P`` must be 1.

    Raises:
        CapacityError: a size that is not a positive integer (``rows``: not >= 0),
            ``per_head`` or ``windowed_staging`` not a bool, or a windowed staging area of
            more than one prompt.
    """

    layers: int
    rows: int
    hot_slots: int
    max_blocks: int
    kv_heads: int
    head_dim: int
    element_bytes: int
    per_head: bool = False
    block_tokens: int = _BLOCK_TOKENS
    staged_prompts: int = 1
    windowed_staging: bool = False

    def __post_init__(self) -> None:
        _non_negative("rows", self.rows)
        for name in (
            "layers",
            "hot_slots",
            "max_blocks",
            "kv_heads",
            "head_dim",
            "element_bytes",
            "block_tokens",
            "staged_prompts",
        ):
            _positive(name, getattr(self, name))
        for name in ("per_head", "windowed_staging"):
            flag: object = getattr(self, name)
            if not isinstance(flag, bool):
                msg = f"{name}={flag!r} is not allowed; allowed: True or False"
                raise CapacityError(msg)
        if self.windowed_staging and self.staged_prompts != 1:
            msg = (
                f"staged_prompts={self.staged_prompts!r} with windowed_staging is not allowed; "
                "a windowed staging area holds one prompt (allowed: 1)"
            )
            raise CapacityError(msg)

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
        element_bytes: int,
        per_head: bool = False,
        block_tokens: int = _BLOCK_TOKENS,
        staged_prompts: int = 1,
        windowed_staging: bool = False,
    ) -> OffloadSizes:
        """The sizes of ``rows`` requests of up to ``context_len`` tokens (``NB`` from it)."""
        _positive("context_len", context_len)
        _positive("block_tokens", block_tokens)
        return cls(
            layers=layers,
            rows=rows,
            hot_slots=hot_slots,
            max_blocks=context_blocks(context_len, block_tokens),
            kv_heads=kv_heads,
            head_dim=head_dim,
            element_bytes=element_bytes,
            per_head=per_head,
            block_tokens=block_tokens,
            staged_prompts=staged_prompts,
            windowed_staging=windowed_staging,
        )

    @property
    def max_tokens(self) -> int:
        """Tokens one row can hold (``NB × block_tokens``)."""
        return self.max_blocks * self.block_tokens

    @property
    def record_heads(self) -> int:
        """KV heads one record holds: ``Hkv``, or 1 with :attr:`per_head`."""
        return 1 if self.per_head else self.kv_heads

    @property
    def store_layers(self) -> int:
        """Record layers ``Ls``: ``L``, or ``L × Hkv`` with :attr:`per_head`."""
        return self.layers * self.kv_heads // self.record_heads

    @property
    def record_bytes(self) -> int:
        """Bytes of one record: ``2 × block_tokens × record_heads × D × element_bytes``."""
        return 2 * self.block_tokens * self.record_heads * self.head_dim * self.element_bytes

    @property
    def staging_bytes(self) -> int:
        """:attr:`staged_prompts` prompts of every record layer, on the device.

        ``P × Ls × NB`` records; windowed (:attr:`windowed_staging`), :data:`WINDOW_LAYERS`
        layers of one prompt and an open block of every record layer,
        ``WINDOW_LAYERS × Ls / L × NB + Ls`` records.
        """
        if self.windowed_staging:
            per_layer = self.store_layers // self.layers
            records = WINDOW_LAYERS * per_layer * self.max_blocks + self.store_layers
            return records * self.record_bytes
        return self.staged_prompts * self.store_layers * self.max_blocks * self.record_bytes

    @property
    def cache_bytes(self) -> int:
        """The hot caches and the open-block tails: ``Ls × R × (S + 1)`` records."""
        return self.store_layers * self.rows * (self.hot_slots + 1) * self.record_bytes

    @property
    def table_bytes(self) -> int:
        """The residency tables: ``Ls × R × (S × 12 + NB × 4)`` bytes.

        An int32 block id and an int64 stamp per hot slot, an int32 slot per arena block (a
        bound under a shard group, whose slot maps cover its own blocks).
        """
        per_row = self.hot_slots * _SLOT_TABLE_BYTES + self.max_blocks * _BLOCK_TABLE_BYTES
        return self.store_layers * self.rows * per_row

    @property
    def device_bytes(self) -> int:
        """What the store allocates on the device: :attr:`cache_bytes` + :attr:`table_bytes`."""
        return self.cache_bytes + self.table_bytes

    def arena_bytes(self, blocks: int | None = None) -> int:
        """Bytes of a host arena of ``blocks`` per (row, record layer) (default ``NB``).

        ``R × Ls × blocks`` records; under a shard group, ``blocks`` is the rank's share.
        """
        count = self.max_blocks if blocks is None else blocks
        return self.rows * self.store_layers * count * self.record_bytes

    @property
    def verification_bytes(self) -> int:
        """The resident copy of every row that verification keeps on the device (the arena)."""
        return self.arena_bytes()

    def fixed_device_bytes(self, *, verify: bool = False) -> int:
        """Device bytes allocated once: staging, hot caches, tails, tables (and verification)."""
        resident = self.verification_bytes if verify else 0
        return self.staging_bytes + resident + self.device_bytes


def ds_offload_sizes(
    *,
    layers: int,
    rows: int,
    context_len: int,
    hot_blocks: int,
    kv_heads: int,
    head_dim: int,
    element_bytes: int,
    windowed_staging: bool = True,
) -> OffloadSizes:
    """DS-Offload's sizes: every attention layer, per-head records, one prompt staged.

    ``hot_blocks`` is what one KV head's decode step may read (double sparsity's
    ``DSConfig.hot_blocks``); a hot cache holds at most a whole context's blocks.
    ``windowed_staging`` (the default) stages a window of layers, not the whole prompt of every
    layer (:attr:`OffloadSizes.windowed_staging`).
    """
    _positive("context_len", context_len)
    _positive("hot_blocks", hot_blocks)
    return OffloadSizes.for_context(
        layers=layers,
        rows=rows,
        context_len=context_len,
        hot_slots=min(hot_blocks, context_blocks(context_len)),
        kv_heads=kv_heads,
        head_dim=head_dim,
        element_bytes=element_bytes,
        per_head=True,
        windowed_staging=windowed_staging,
    )


def label_bytes_per_token(
    layers: int, kv_heads: int, heavy_channels: int, label_element_bytes: int
) -> int:
    """Double sparsity's label rows of one token slot: ``layers × kv_heads × C × element``.

    Raises:
        CapacityError: a size that is not a positive integer.
    """
    for name, value in (
        ("layers", layers),
        ("kv_heads", kv_heads),
        ("heavy_channels", heavy_channels),
        ("label_element_bytes", label_element_bytes),
    ):
        _positive(name, value)
    return layers * kv_heads * heavy_channels * label_element_bytes


def sharded_token_bytes(
    raw_bytes: int, index_bytes: int, sharding_size: int, *, index_sharded: bool = False
) -> int:
    """A token's price under resident cache sharding: ``1 / N`` of its raw K/V and its index.

    ``index_bytes + ceil(raw_bytes / sharding_size)``: each of the ``N`` ranks of a shard group
    stores the raw K/V of its own pages; the compressed index stays on every rank. With
    ``index_sharded`` (D2: the index sharded by page too) the index term is
    ``ceil(index_bytes / sharding_size)``.

    Raises:
        CapacityError: a negative byte count or a ``sharding_size`` that is not positive.
    """
    _non_negative("raw_bytes", raw_bytes)
    _non_negative("index_bytes", index_bytes)
    _positive("sharding_size", sharding_size)
    index = -(-index_bytes // sharding_size) if index_sharded else index_bytes
    return index + -(-raw_bytes // sharding_size)
