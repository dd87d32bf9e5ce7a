"""Capacity plan: the bytes of every per-rank memory part, with and without host KV offload.

All figures are per TP rank, in bytes, and exact integer arithmetic from the profile. They are
what the engine allocates and its pool sizing charges: each layout's price per token and fixed
bytes are a :class:`PoolPrice` (:attr:`CapacityPlan.offloaded_price`,
:attr:`CapacityPlan.resident_price`), built by the methods the plugin's pool sizing calls, and
the offload's buffers come from :class:`OffloadSizes` (the arithmetic the offload's store
allocates by), with ``Ls = qsa_layers`` record layers of one 4-token block of every KV head,
``NB = ceil(L / ratio)`` blocks of a context, ``S`` hot slots and ``block_bytes`` per record:

* raw K/V (resident only, GPU): ``(R × L + page) × raw_bytes_per_token``; under resident cache
  sharding over ``N`` ranks ``(R × L + page) × ceil(raw_bytes_per_token / N)``
  (:meth:`PoolPrice.sharded`, :func:`sharded_token_bytes`);
* compressed index-K (GPU, never offloaded, replicated on every rank):
  ``(R × L + page) × index_bytes_per_token``; with offload it is all a token costs in the
  engine's pool (:meth:`PoolPrice.offloaded`); with the index sharded by page (D2,
  ``index_sharded``) over the cache sharding's ``N`` ranks, or over every TP rank without cache
  sharding (:func:`index_ranks`), offloaded or resident,
  ``(R × L + page) × ceil(index_bytes_per_token / N)``;
* pending ring (GPU): ``R × (qsa_layers × ratio × index_kv_heads × index_head_dim × 2 B + ratio × 3
  × 8 B)`` (bf16 raw index keys plus their int64 3-axis RoPE positions);
* GDN recurrent state (GPU, fp32): ``slots × linear_layers × (value_heads / TP) × key_dim ×
  value_dim × 4 B``;
* GDN conv state (GPU, bf16): ``slots × linear_layers × (conv_dim / TP) × (kernel - 1) × 2 B`` with
  ``conv_dim = 2 × key_heads × key_dim + value_heads × value_dim``;
* PLE short-conv state (GPU, bf16, replicated): ``slots × ple_layers × hidden × hc_count ×
  (ple_kernel - 1) × ngram × 2 B``;
* prefill staging (offload only, GPU): ``P`` prompts (one per request of a prefill batch) of
  every QSA layer in whole blocks, ``P × Ls × NB × block_bytes``;
* hot caches and tails (offload only, GPU): ``Ls × R × (S + 1) × block_bytes`` (one open-block
  tail record per layer and request);
* residency tables (offload only, GPU): ``Ls × R × (S × 12 + NB × 4)`` bytes;
* verification copy (offload with ``verify`` only, GPU): a resident copy of every row, the host
  arena's unsharded size (:attr:`OffloadSizes.verification_bytes`);
* shard transport buffers (GPU): resident cache sharding's ``transport_bytes``, the fixed
  bytes of the sharded store's (and with D2 the sharded index's) collective buffers; with
  offload and D2, ``index_buffer_bytes``, the sharded index's candidate buffers alone. The
  caller computes both (``qsa_kernels.sharded``; the plugin's adapter does);
* host arena (offload only, pinned host): ``R × Ls × NB × block_bytes``; with cache sharding over
  ``N`` ranks, the blocks of the busiest rank (:meth:`ShardPlacement.blocks_on_rank`: whole
  16-block pages, every ``N``-th).

``R`` is the request count, ``L`` the context length in tokens, ``slots`` the recurrent-state
slots (``R`` unless given). ``S`` is :func:`hot_cache_slots`: 4 × the block top-k unless given,
no more than a context's blocks and never fewer than the top-k. Staging, hot caches, tails and
tables are the fixed bytes the engine's pool sizing charges before it sizes the index pool
(:meth:`OffloadSizes.fixed_device_bytes`, :attr:`PoolPrice.fixed_bytes`). With the
Qwen3.8-Flash-Next TP2 FP8 setup of 8 × 262,144 tokens: 6,144 B raw and 768 B index per token,
1.5 GiB host K/V per request (12 GiB for eight), staging 1.5 GiB, hot caches and tails 384.188
MiB, tables 26.25 MiB: 2,040,987,648 B of fixed device bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from qsa_core._checks import is_int
from qsa_core._errors import CapacityError
from qsa_core._offload_sizes import OffloadSizes, context_blocks, sharded_token_bytes
from qsa_core._placement import ShardPlacement
from qsa_core._pool_price import PoolPrice
from qsa_core._profile import KVDType, QSAProfile

__all__ = (
    "HOT_SLOTS_PER_TOPK",
    "CapacityPlan",
    "MemoryLayout",
    "MemoryPart",
    "MemoryPartKind",
    "MemoryTier",
    "hot_cache_slots",
    "plan_capacity",
)

#: Bytes of one pending-ring RoPE coordinate (3 axes × int64).
_ROPE_POSITION_BYTES = 3 * 8
_RING_DTYPE_BYTES = 2  # the pending ring is always bf16
_SSM_STATE_BYTES = 4  # fp32 GDN recurrent state
_CONV_STATE_BYTES = 2  # bf16 conv windows
_SEARCH_LIMIT = 2**40  # request counts beyond this are reported as this bound
#: Hot-cache block slots per (request, QSA layer), per block the indexer selects, unless
#: configured: a block that drops out of the selection stays cached while three selections'
#: worth of newer blocks arrive (the selection of consecutive steps overlaps, and blocks return).
HOT_SLOTS_PER_TOPK: Final = 4


class MemoryTier(enum.Enum):
    """Where a part lives."""

    GPU = "gpu"
    HOST = "host"


class MemoryPartKind(enum.Enum):
    """The parts a plan prices, in table order."""

    RAW_KV = "raw K/V"
    COMPRESSED_INDEX = "compressed index-K"
    PENDING_RING = "pending ring + RoPE"
    GDN_STATE = "GDN recurrent state"
    CONV_STATE = "GDN conv state"
    PLE_STATE = "PLE short-conv state"
    PREFILL_AREA = "prefill staging"
    HOT_CACHE = "hot caches + tails"
    RESIDENCY_TABLES = "residency tables"
    VERIFICATION = "verification copy"
    SHARD_TRANSPORT = "shard transport buffers"
    HOST_ARENA = "host K/V arena"


@dataclass(frozen=True, slots=True)
class MemoryPart:
    """One priced part.

    Attributes:
        kind: which part.
        tier: GPU or pinned host memory.
        nbytes: bytes per rank.
        formula: the arithmetic, for the table.
    """

    kind: MemoryPartKind
    tier: MemoryTier
    nbytes: int
    formula: str


@dataclass(frozen=True, slots=True)
class MemoryLayout:
    """Every part of one mode (offloaded or resident) for ``num_requests`` requests."""

    offloaded: bool
    num_requests: int
    parts: tuple[MemoryPart, ...]

    @property
    def gpu_bytes(self) -> int:
        """Sum of the GPU parts."""
        return sum(p.nbytes for p in self.parts if p.tier is MemoryTier.GPU)

    @property
    def host_bytes(self) -> int:
        """Sum of the host parts."""
        return sum(p.nbytes for p in self.parts if p.tier is MemoryTier.HOST)

    def part(self, kind: MemoryPartKind) -> MemoryPart:
        """The part of ``kind`` (bytes 0 when the mode does not use it)."""
        for p in self.parts:
            if p.kind is kind:
                return p
        msg = f"layout has no part {kind!r}"
        raise KeyError(msg)

    def fits(self, gpu_budget_bytes: int, host_budget_bytes: int) -> bool:
        """True when both totals are within the budgets."""
        return self.gpu_bytes <= gpu_budget_bytes and self.host_bytes <= host_budget_bytes


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """The inputs, both layouts and the largest request counts that fit.

    Attributes:
        profile: model geometry.
        tp_size: tensor-parallel size (figures are per rank).
        kv_dtype: raw K/V dtype.
        index_dtype: compressed index dtype.
        gpu_budget_bytes: GPU bytes available for KV and per-request state, per rank.
        host_budget_bytes: pinned host bytes available, per rank.
        context_len: tokens per request.
        num_requests: requests to plan for.
        hot_slots: hot block slots per request per layer (:func:`hot_cache_slots`).
        state_slots: recurrent-state slots (``None``: one per request).
        offloaded: the layout with host KV offload.
        resident: the layout with all raw K/V on the GPU.
        max_requests_offloaded: most requests of ``context_len`` that fit with offload.
        max_requests_resident: most requests of ``context_len`` that fit without offload.
        sharding_size: ranks of a shard group that store the K/V once (1 = off): the
            offloaded K/V's host arena, or the resident raw K/V, divides by it.
        staged_prompts: prompts the offload stages at once (an engine's prefill batch).
        index_sharded: the compressed index is sharded by page over the same ``N`` ranks (D2),
            or without sharding (``N`` 1) over every TP rank (:func:`index_ranks`).
        transport_bytes: fixed device bytes of the shard group's transport buffers (resident
            cache sharding only; 0 without it).
        index_buffer_bytes: fixed device bytes of the sharded index's candidate buffers in the
            offloaded layout (D2 with offload), or in the resident one (D2 alone); 0 without D2.
        verify: the offload keeps a resident copy of every row (``SGLANG_QSA_HISPARSE_VERIFY``).
    """

    profile: QSAProfile
    tp_size: int
    kv_dtype: KVDType
    index_dtype: KVDType
    gpu_budget_bytes: int
    host_budget_bytes: int
    context_len: int
    num_requests: int
    hot_slots: int
    state_slots: int | None
    offloaded: MemoryLayout
    resident: MemoryLayout
    max_requests_offloaded: int
    max_requests_resident: int
    sharding_size: int = 1
    staged_prompts: int = 1
    index_sharded: bool = False
    transport_bytes: int = 0
    verify: bool = False
    index_buffer_bytes: int = 0

    @property
    def raw_bytes_per_token(self) -> int:
        """Raw K/V bytes per token per rank over all QSA layers."""
        return self.profile.raw_kv_bytes_per_token(self.kv_dtype, self.tp_size)

    @property
    def index_bytes_per_token(self) -> int:
        """Compressed index bytes per token (every rank, unsharded)."""
        return self.profile.index_bytes_per_token(self.index_dtype)

    @property
    def index_bytes_per_token_per_rank(self) -> int:
        """Compressed index bytes per token on one rank (``1 / N`` with D2)."""
        return sharded_token_bytes(
            0,
            self.index_bytes_per_token,
            index_ranks(self.sharding_size, self.tp_size),
            index_sharded=self.index_sharded,
        )

    @property
    def resident_token_bytes(self) -> int:
        """A token's price in the engine's pool without offload (index + raw, sharded), B."""
        return self.resident_price.token_bytes

    @property
    def resident_price(self) -> PoolPrice:
        """What the engine's pool sizing charges without offload, per rank.

        SGLang's own price (raw K/V and index per token, nothing fixed), or under resident cache
        sharding :meth:`PoolPrice.sharded` (the transport buffers fixed).
        """
        return self._price(offloaded=False)

    @property
    def offloaded_price(self) -> PoolPrice:
        """What the engine's pool sizing charges with ``p2-offload``, per rank.

        :meth:`PoolPrice.offloaded`: a token costs its compressed index (``1 / N`` of it with
        D2); the offload's staging, hot caches, tails and tables (:attr:`offload`), and with D2
        the index's candidate buffers (:attr:`index_buffer_bytes`), are fixed.
        """
        return self._price(offloaded=True)

    def _price(self, *, offloaded: bool) -> PoolPrice:
        return _pool_price(
            self.profile,
            tp_size=self.tp_size,
            kv_dtype=self.kv_dtype,
            index_dtype=self.index_dtype,
            sizes=self.offload,
            offloaded=offloaded,
            sharding_size=self.sharding_size,
            index_sharded=self.index_sharded,
            transport_bytes=self.transport_bytes,
            verify=self.verify,
            index_buffer_bytes=self.index_buffer_bytes,
        )

    @property
    def offload(self) -> OffloadSizes:
        """The offload's buffers for ``num_requests`` rows of ``context_len`` tokens.

        ``offload.fixed_device_bytes()`` is the fixed overhead the engine's pool sizing charges
        with offload (:attr:`offloaded_price`).
        """
        return _offload_sizes(
            self.profile,
            tp_size=self.tp_size,
            kv_dtype=self.kv_dtype,
            context_len=self.context_len,
            num_requests=self.num_requests,
            hot_slots=self.hot_slots,
            staged_prompts=self.staged_prompts,
        )

    @property
    def bytes_per_block(self) -> int:
        """Raw K/V bytes of one block of one layer per rank."""
        return self.profile.bytes_per_block(self.kv_dtype, self.tp_size)

    @property
    def host_bytes_per_request(self) -> int:
        """Host arena bytes of one request of ``context_len`` tokens (on the busiest rank)."""
        blocks = _host_blocks(self.profile, self.context_len, self.sharding_size)
        return blocks * self._layer_block_bytes

    @property
    def _layer_block_bytes(self) -> int:
        return self.profile.num_qsa_layers * self.bytes_per_block


def _host_blocks(profile: QSAProfile, context_len: int, sharding_size: int = 1) -> int:
    """Host arena blocks of one request per layer, on the shard group's busiest rank (rank 0)."""
    blocks = -(-context_len // profile.compress_ratio)
    placement = ShardPlacement(sharding_size, profile.blocks_per_page, profile.compress_ratio)
    return placement.blocks_on_rank(blocks, 0)


def _offload_sizes(
    profile: QSAProfile,
    *,
    tp_size: int,
    kv_dtype: KVDType,
    context_len: int,
    num_requests: int,
    hot_slots: int,
    staged_prompts: int = 1,
) -> OffloadSizes:
    """The offload's sizes: every QSA layer, one record per block of the rank's KV heads."""
    return OffloadSizes.for_context(
        layers=profile.num_qsa_layers,
        rows=num_requests,
        context_len=context_len,
        hot_slots=hot_slots,
        kv_heads=profile.kv_heads_per_rank(tp_size),
        head_dim=profile.head_dim,
        element_bytes=kv_dtype.itemsize,
        block_tokens=profile.compress_ratio,
        staged_prompts=staged_prompts,
    )


def index_ranks(sharding_size: int, tp_size: int) -> int:
    """Ranks that share the compressed index's pages under D2.

    The shard group's with D1; every TP rank without it (``sharding_size`` 1: the index has no
    head split).
    """
    return sharding_size if sharding_size > 1 else tp_size


def _pool_price(
    profile: QSAProfile,
    *,
    tp_size: int,
    kv_dtype: KVDType,
    index_dtype: KVDType,
    sizes: OffloadSizes,
    offloaded: bool,
    sharding_size: int,
    index_sharded: bool,
    transport_bytes: int,
    verify: bool = False,
    index_buffer_bytes: int = 0,
) -> PoolPrice:
    """The engine's pool price of one layout: offloaded, resident, or resident and sharded."""
    raw = profile.raw_kv_bytes_per_token(kv_dtype, tp_size)
    index = profile.index_bytes_per_token(index_dtype)
    if offloaded:  # D2 on the host arenas' groups, or over every TP rank without them
        ranks = index_ranks(sharding_size, tp_size) if index_sharded else 1
        return PoolPrice.offloaded(
            sizes,
            resident_token_bytes=raw + index,
            index_token_bytes=index,
            verify=verify,
            index_ranks=ranks,
            index_buffer_bytes=index_buffer_bytes,  # plan_capacity allows them only with D2
        )
    if index_sharded and sharding_size == 1:
        return PoolPrice.index_sharded(
            resident_token_bytes=raw + index,
            index_token_bytes=index,
            index_ranks=tp_size,
            index_buffer_bytes=index_buffer_bytes,
        )
    if sharding_size > 1:
        return PoolPrice.sharded(
            resident_token_bytes=raw + index,
            index_token_bytes=index,
            sharding_size=sharding_size,
            transport_bytes=transport_bytes,
            index_sharded=index_sharded,
        )
    detail = (
        f"pool sizing charges {raw + index} B per token ({raw} B of raw K/V, {index} B of index)"
    )
    return PoolPrice(raw + index, 0, detail)


def _split(total: int, tp_size: int, name: str) -> int:
    if total % tp_size != 0:
        msg = f"{name}={total!r} does not split over tp_size={tp_size!r}; it must be a multiple"
        raise CapacityError(msg)
    return total // tp_size


def _layout(
    profile: QSAProfile,
    *,
    tp_size: int,
    kv_dtype: KVDType,
    index_dtype: KVDType,
    context_len: int,
    num_requests: int,
    hot_slots: int,
    state_slots: int,
    offloaded: bool,
    sharding_size: int,
    staged_prompts: int,
    index_sharded: bool = False,
    transport_bytes: int = 0,
    verify: bool = False,
    index_buffer_bytes: int = 0,
) -> MemoryLayout:
    p = profile
    n, ctx, page = num_requests, context_len, p.page_size
    sizes = _offload_sizes(
        p,
        tp_size=tp_size,
        kv_dtype=kv_dtype,
        context_len=ctx,
        num_requests=n,
        hot_slots=hot_slots,
        staged_prompts=staged_prompts,
    )
    price = _pool_price(
        p,
        tp_size=tp_size,
        kv_dtype=kv_dtype,
        index_dtype=index_dtype,
        sizes=sizes,
        offloaded=offloaded,
        sharding_size=sharding_size,
        index_sharded=index_sharded,
        transport_bytes=transport_bytes,
        verify=verify,
        index_buffer_bytes=index_buffer_bytes,
    )
    # What a token costs the pool, split into its raw K/V (resident only) and its index.
    idx_tok = (
        price.token_bytes
        if offloaded
        else sharded_token_bytes(
            0,
            p.index_bytes_per_token(index_dtype),
            index_ranks(sharding_size, tp_size),
            index_sharded=index_sharded,
        )
    )
    resident_raw = price.token_bytes - idx_tok
    d2 = index_sharded and index_ranks(sharding_size, tp_size) > 1
    block, layers, nb = sizes.record_bytes, sizes.store_layers, sizes.max_blocks
    gpu, host = MemoryTier.GPU, MemoryTier.HOST

    ring_per_req = (
        layers * p.compress_ratio * p.index_kv_heads * p.index_head_dim * _RING_DTYPE_BYTES
        + p.compress_ratio * _ROPE_POSITION_BYTES
    )
    ssm_per_slot = (
        p.num_linear_layers
        * _split(p.linear_num_value_heads, tp_size, "linear_num_value_heads")
        * p.linear_key_head_dim
        * p.linear_value_head_dim
        * _SSM_STATE_BYTES
    )
    conv_dim = 2 * p.linear_num_key_heads * p.linear_key_head_dim + (
        p.linear_num_value_heads * p.linear_value_head_dim
    )
    conv_per_slot = (
        p.num_linear_layers
        * _split(conv_dim, tp_size, "linear conv_dim")
        * max(p.linear_conv_kernel_dim - 1, 0)
        * _CONV_STATE_BYTES
    )
    ple_per_slot = (
        len(p.ple_layer_ids)
        * p.hidden_size
        * p.hc_count
        * max(p.ple_conv_kernel_size - 1, 0)
        * p.ngram_size
        * _CONV_STATE_BYTES
    )
    host_blocks = _host_blocks(p, ctx, sharding_size)

    parts = (
        MemoryPart(
            MemoryPartKind.RAW_KV,
            gpu,
            0 if offloaded else (n * ctx + page) * resident_raw,
            "offloaded to host" if offloaded else f"({n}×{ctx} + {page}) tok × {resident_raw} B",
        ),
        MemoryPart(
            MemoryPartKind.COMPRESSED_INDEX,
            gpu,
            (n * ctx + page) * idx_tok,
            f"({n}×{ctx} + {page}) tok × {idx_tok} B",
        ),
        MemoryPart(
            MemoryPartKind.PENDING_RING, gpu, n * ring_per_req, f"{n} req × {ring_per_req} B"
        ),
        MemoryPart(
            MemoryPartKind.GDN_STATE,
            gpu,
            state_slots * ssm_per_slot,
            f"{state_slots} slots × {ssm_per_slot} B (fp32)",
        ),
        MemoryPart(
            MemoryPartKind.CONV_STATE,
            gpu,
            state_slots * conv_per_slot,
            f"{state_slots} slots × {conv_per_slot} B (bf16)",
        ),
        MemoryPart(
            MemoryPartKind.PLE_STATE,
            gpu,
            state_slots * ple_per_slot,
            f"{state_slots} slots × {ple_per_slot} B (bf16)",
        ),
        MemoryPart(
            MemoryPartKind.PREFILL_AREA,
            gpu,
            sizes.staging_bytes if offloaded else 0,
            f"{staged_prompts} prompts × {layers} layers × {nb} blocks × {block} B"
            if offloaded
            else "prefill writes the raw K/V pool",
        ),
        MemoryPart(
            MemoryPartKind.HOT_CACHE,
            gpu,
            sizes.cache_bytes if offloaded else 0,
            f"{n} req × {layers} layers × ({hot_slots} + 1) blocks × {block} B"
            if offloaded
            else "none",
        ),
        MemoryPart(
            MemoryPartKind.RESIDENCY_TABLES,
            gpu,
            sizes.table_bytes if offloaded else 0,
            f"{n} req × {layers} layers × ({hot_slots} × 12 + {nb} × 4) B" if offloaded else "none",
        ),
        MemoryPart(
            MemoryPartKind.VERIFICATION,
            gpu,
            sizes.verification_bytes if offloaded and verify else 0,
            f"{n} req × {layers} layers × {nb} blocks × {block} B" if verify else "none",
        ),
        MemoryPart(
            MemoryPartKind.SHARD_TRANSPORT,
            gpu,
            index_buffer_bytes if offloaded else price.fixed_bytes,
            _transport_formula(offloaded, index_sharded=d2, sharded=sharding_size > 1),
        ),
        MemoryPart(
            MemoryPartKind.HOST_ARENA,
            host,
            sizes.arena_bytes(host_blocks) if offloaded else 0,
            f"{n} req × {layers} layers × {host_blocks} blocks × {block} B"
            if offloaded
            else "none",
        ),
    )
    return MemoryLayout(offloaded, n, parts)


def _transport_formula(offloaded: bool, *, index_sharded: bool, sharded: bool) -> str:
    if not offloaded:
        return "collective buffers" if sharded or not index_sharded else "index candidate buffers"
    return "index candidate buffers (D2)" if index_sharded else "none"


def _check_int_at_least(name: str, value: int, minimum: int = 1) -> None:
    if not is_int(value) or value < minimum:
        msg = f"{name}={value!r} is not allowed; it must be an integer >= {minimum}"
        raise CapacityError(msg)


def hot_cache_slots(
    block_topk: int, hot_slots: int | None = None, *, context_len: int | None = None
) -> int:
    """Hot-cache block slots per (request, QSA layer), as the offload allocates them.

    ``hot_slots``, by default :data:`HOT_SLOTS_PER_TOPK` × ``block_topk``; with
    ``context_len``, no more than a context's 4-token blocks (a hot cache never holds more) but
    never fewer than ``block_topk`` (one step's selection).

    Raises:
        CapacityError: ``block_topk`` is not a positive int, ``hot_slots`` is not an int of at
            least ``block_topk`` (one step's selection must fit), or ``context_len`` is not a
            positive int.
    """
    _check_int_at_least("block_topk", block_topk)
    slots = HOT_SLOTS_PER_TOPK * block_topk if hot_slots is None else hot_slots
    if not is_int(slots) or slots < block_topk:
        msg = (
            f"hot_slots={slots!r} is not allowed; it must be an integer >= block_topk="
            f"{block_topk!r} (one step's selection)"
        )
        raise CapacityError(msg)
    if context_len is None:
        return slots
    _check_int_at_least("context_len", context_len)
    return max(block_topk, min(slots, context_blocks(context_len)))


def plan_capacity(
    profile: QSAProfile,
    *,
    tp_size: int,
    kv_dtype: KVDType,
    gpu_budget_bytes: int,
    host_budget_bytes: int,
    context_len: int,
    num_requests: int,
    index_dtype: KVDType = KVDType.BF16,
    hot_slots: int | None = None,
    state_slots: int | None = None,
    sharding_size: int = 1,
    staged_prompts: int = 1,
    index_sharded: bool = False,
    transport_bytes: int = 0,
    verify: bool = False,
    index_buffer_bytes: int = 0,
) -> CapacityPlan:
    """Price every per-rank memory part with and without offload, and the largest request count.

    Args:
        profile: model geometry.
        tp_size: TP size (figures are per rank).
        kv_dtype: raw K/V dtype.
        gpu_budget_bytes: GPU bytes for KV and per-request state, per rank.
        host_budget_bytes: pinned host bytes, per rank.
        context_len: tokens per request.
        num_requests: requests to plan for.
        index_dtype: compressed index dtype (bf16 by default).
        hot_slots: hot block slots per request per layer (default 4 × the block top-k); capped
            as the offload caps it (:func:`hot_cache_slots` with ``context_len``).
        state_slots: recurrent-state slots (default: one per request; when given, the fit search
            uses ``max(state_slots, R)``).
        sharding_size: TP ranks of one K/V head that share its K/V (the offloaded host arena
            and the resident raw K/V divide by it; :meth:`ShardPlacement.for_tp` rules).
        staged_prompts: prompts the offload stages at once (``--prefill-max-requests``).
        index_sharded: the compressed index sharded by page (D2) over :func:`index_ranks`:
            the ``sharding_size`` ranks, or with ``sharding_size`` 1 every TP rank (D2 alone,
            the raw K/V whole); its GPU bytes per rank divide by them, with offload or
            without.
        transport_bytes: device bytes of the shard group's transport buffers for
            ``num_requests`` rows (``qsa_kernels.sharded``), fixed in the resident layout when
            ``sharding_size > 1``; must be 0 otherwise.
        verify: the offload keeps a resident copy of every row on the device (a debug switch,
            ``SGLANG_QSA_HISPARSE_VERIFY=1``): a fixed part of the offloaded layout.
        index_buffer_bytes: device bytes of the sharded index's candidate buffers
            (``qsa_kernels.sharded``), fixed in the offloaded layout with ``index_sharded``,
            and in the resident layout with ``index_sharded`` alone (``sharding_size`` 1),
            when :func:`index_ranks` is above 1; must be 0 otherwise.

    Returns:
        The plan; ``max_requests_*`` are the largest ``R`` whose layout fits both budgets.

    Raises:
        CapacityError: a non-positive size, a negative budget, ``hot_slots < block_topk``,
            recurrent heads that do not split over ``tp_size``, ``transport_bytes`` that is
            negative or given without sharding, ``index_buffer_bytes`` that is negative or
            given without D2, or a ``verify`` that is not a bool.
        QSAConfigError: ``tp_size`` does not split the KV heads.
        PlacementError: ``sharding_size`` is not a shard group inside one K/V head's replicas.
    """
    _check_int_at_least("tp_size", tp_size)
    _check_int_at_least("context_len", context_len)
    _check_int_at_least("num_requests", num_requests, minimum=0)
    _check_int_at_least("gpu_budget_bytes", gpu_budget_bytes, minimum=0)
    _check_int_at_least("host_budget_bytes", host_budget_bytes, minimum=0)
    _check_int_at_least("staged_prompts", staged_prompts)
    _check_int_at_least("transport_bytes", transport_bytes, minimum=0)
    _check_int_at_least("index_buffer_bytes", index_buffer_bytes, minimum=0)
    verify_flag: object = verify  # callers may be untyped
    if not isinstance(verify_flag, bool):
        msg = f"verify={verify!r} is not allowed; allowed: True or False"
        raise CapacityError(msg)
    if transport_bytes and sharding_size == 1:
        msg = (
            f"transport_bytes={transport_bytes!r} is not allowed with sharding_size=1; "
            "transport buffers belong to a shard group (allowed: 0)"
        )
        raise CapacityError(msg)
    if index_buffer_bytes and not (index_sharded and index_ranks(sharding_size, tp_size) > 1):
        msg = (
            f"index_buffer_bytes={index_buffer_bytes!r} is not allowed without the index sharded "
            f"over a shard group (index_sharded={index_sharded!r}, sharding_size="
            f"{sharding_size!r}, tp_size={tp_size!r}); candidate buffers belong to a sharded "
            "index (allowed: 0)"
        )
        raise CapacityError(msg)
    dtypes: tuple[tuple[str, object], ...] = (("kv_dtype", kv_dtype), ("index_dtype", index_dtype))
    for name, dtype in dtypes:
        if not isinstance(dtype, KVDType):
            allowed = ", ".join(f"KVDType.{d.name}" for d in KVDType)
            msg = (
                f"{name}={dtype!r} is not allowed; it must be a KVDType ({allowed}); parse a "
                "flag with KVDType.parse"
            )
            raise CapacityError(msg)
    hot = hot_cache_slots(profile.block_topk, hot_slots, context_len=context_len)
    if state_slots is not None:
        _check_int_at_least("state_slots", state_slots, minimum=0)
    profile.kv_heads_per_rank(tp_size)
    ShardPlacement.for_tp(profile, tp_size, sharding_size)

    def layout(n: int, offloaded: bool, slots: int) -> MemoryLayout:
        return _layout(
            profile,
            tp_size=tp_size,
            kv_dtype=kv_dtype,
            index_dtype=index_dtype,
            context_len=context_len,
            num_requests=n,
            hot_slots=hot,
            state_slots=slots,
            offloaded=offloaded,
            sharding_size=sharding_size,
            staged_prompts=staged_prompts,
            index_sharded=index_sharded,
            transport_bytes=transport_bytes,
            verify=verify,
            index_buffer_bytes=index_buffer_bytes,
        )

    def largest(offloaded: bool) -> int:
        def fits(n: int) -> bool:
            slots = n if state_slots is None else max(state_slots, n)
            return layout(n, offloaded, slots).fits(gpu_budget_bytes, host_budget_bytes)

        if not fits(1):
            return 0
        low, high = 1, 2
        while high < _SEARCH_LIMIT and fits(high):
            low, high = high, high * 2
        while high - low > 1:  # fits(low) and not fits(high)
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    slots = num_requests if state_slots is None else state_slots
    return CapacityPlan(
        profile=profile,
        tp_size=tp_size,
        kv_dtype=kv_dtype,
        index_dtype=index_dtype,
        gpu_budget_bytes=gpu_budget_bytes,
        host_budget_bytes=host_budget_bytes,
        context_len=context_len,
        num_requests=num_requests,
        hot_slots=hot,
        state_slots=state_slots,
        offloaded=layout(num_requests, True, slots),
        resident=layout(num_requests, False, slots),
        max_requests_offloaded=largest(True),
        max_requests_resident=largest(False),
        sharding_size=sharding_size,
        staged_prompts=staged_prompts,
        index_sharded=index_sharded,
        transport_bytes=transport_bytes,
        verify=verify,
        index_buffer_bytes=index_buffer_bytes,
    )
