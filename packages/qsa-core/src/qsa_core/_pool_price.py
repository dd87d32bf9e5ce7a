"""What an engine's KV pool sizing charges under each feature that changes a token's price.

An engine sizes its token pool by a price per token slot after charging the buffers it
allocates once. Each feature reprices what the engine computed for resident K/V:

- request offload (:meth:`PoolPrice.offloaded`): a token costs its compressed index only (with
  the index sharded by page, D2, ``1 / N`` of it); the offload's staging, hot caches, tails and
  tables (:meth:`OffloadSizes.fixed_device_bytes`), and with D2 the index's candidate buffers,
  are fixed;
- resident cache sharding (:meth:`PoolPrice.sharded`): a token costs its index and ``1 / N`` of
  its raw K/V (:func:`sharded_token_bytes`); the transport buffers are fixed;
- double sparsity (:meth:`PoolPrice.labelled`): a token also costs its label rows
  (:func:`label_bytes_per_token`); with DS-Offload its label rows alone, and the offload's
  buffers are fixed.

:func:`qsa_core.plan_capacity` prices its layouts with these same methods
(:attr:`CapacityPlan.offloaded_price`, :attr:`CapacityPlan.resident_price`), so the figures it
prints are the ones the engine's pool sizing charges for the same flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from qsa_core._errors import CapacityError
from qsa_core._offload_sizes import (
    OffloadSizes,
    _non_negative,
    _positive,
    sharded_token_bytes,
)
from qsa_core._units import format_bytes

__all__ = ("PoolPrice",)

#: What an offload's fixed device bytes hold, as the log lines name them.
_OFFLOAD_BUFFERS: Final = "fixed (staging, hot caches, tails, tables)"


@dataclass(frozen=True, slots=True)
class PoolPrice:
    """The price an engine's pool sizing charges, and one line saying what it is made of.

    Attributes:
        token_bytes: bytes of one token slot of the pool (per rank).
        fixed_bytes: device bytes allocated once, charged before the pool is sized.
        detail: what the price is made of and what it was, for the engine's log.
    """

    token_bytes: int
    fixed_bytes: int
    detail: str

    def pool_tokens(self, available_bytes: int, page_size: int = 1) -> int:
        """Token slots of a pool sized from ``available_bytes`` of device memory (per rank).

        As SGLang's ``DefaultPoolConfigurator.calculate_pool_sizes``: the fixed bytes first,
        then whole token slots, rounded down to whole pages of ``page_size`` tokens.

        Raises:
            CapacityError: a negative ``available_bytes``, a ``page_size`` that is not positive,
                or a price of 0 B per token.
        """
        _non_negative("available_bytes", available_bytes)
        _positive("page_size", page_size)
        _positive("token_bytes", self.token_bytes)
        tokens = max(available_bytes - self.fixed_bytes, 0) // self.token_bytes
        return tokens // page_size * page_size

    @classmethod
    def offloaded(
        cls,
        sizes: OffloadSizes,
        *,
        resident_token_bytes: int,
        index_token_bytes: int,
        verify: bool = False,
        index_ranks: int = 1,
        index_buffer_bytes: int = 0,
    ) -> PoolPrice:
        """Request offload: a token costs its compressed index; the offload's buffers are fixed.

        Args:
            sizes: the offload's sizes (its staging, hot caches, tails and tables).
            resident_token_bytes: the engine's price of a token with its K/V resident.
            index_token_bytes: the engine's price of a token's compressed index alone.
            verify: the offload keeps a resident copy of every row (verification).
            index_ranks: ranks the index is sharded over by page (D2; 1 = not sharded): the
                host arenas' shard group, or every TP rank without cache sharding. A token
                costs ``ceil(index_token_bytes / index_ranks)``.
            index_buffer_bytes: with ``index_ranks > 1``, the index shard's candidate buffers
                (fixed, beside the offload's).

        Raises:
            CapacityError: a negative byte count, an ``index_ranks`` that is not positive, or
                ``index_buffer_bytes`` with an index that is not sharded.
        """
        _non_negative("resident_token_bytes", resident_token_bytes)
        _non_negative("index_token_bytes", index_token_bytes)
        _non_negative("index_buffer_bytes", index_buffer_bytes)
        _positive("index_ranks", index_ranks)
        sharded = index_ranks > 1
        if index_buffer_bytes and not sharded:
            msg = (
                f"index_buffer_bytes={index_buffer_bytes!r} is not allowed with "
                f"index_ranks={index_ranks!r}; candidate buffers belong to an index sharded over "
                "2 or more ranks (allowed: 0)"
            )
            raise CapacityError(msg)
        token = sharded_token_bytes(0, index_token_bytes, index_ranks, index_sharded=sharded)
        fixed = sizes.fixed_device_bytes(verify=verify)
        was = f"was {resident_token_bytes} B with the QSA layers' K/V"
        if sharded:
            was += f"; {index_token_bytes} B of index over {index_ranks} ranks"
        detail = f"pool sizing charges {token} B per token ({was}) plus "
        buffers = f"{format_bytes(fixed)} {_OFFLOAD_BUFFERS}"
        if sharded:
            buffers += f" and {format_bytes(index_buffer_bytes)} of index candidate buffers"
        return cls(token, fixed + index_buffer_bytes, f"{detail}{buffers}")

    @classmethod
    def sharded(
        cls,
        *,
        resident_token_bytes: int,
        index_token_bytes: int,
        sharding_size: int,
        transport_bytes: int,
        index_sharded: bool = False,
    ) -> PoolPrice:
        """Resident cache sharding: the index and ``1 / N`` of the raw K/V; transport is fixed.

        The raw K/V of a token is what resident K/V costs beyond its index. With
        ``index_sharded`` (D2) the index costs ``1 / N`` too, and ``transport_bytes`` should
        include the index shard's candidate buffers.

        Raises:
            CapacityError: a negative byte count, an index dearer than the whole token, or a
                ``sharding_size`` that is not positive.
        """
        _non_negative("transport_bytes", transport_bytes)
        raw = resident_token_bytes - index_token_bytes
        token = sharded_token_bytes(
            raw, index_token_bytes, sharding_size, index_sharded=index_sharded
        )
        index = (
            f"{index_token_bytes} B of index over {sharding_size} ranks"
            if index_sharded
            else f"{index_token_bytes} B of index and state"
        )
        detail = (
            f"pool sizing charges {token} B per token (was {resident_token_bytes} B: {raw} B of "
            f"raw K/V over {sharding_size} ranks, {index}) plus "
            f"{format_bytes(transport_bytes)} of transport buffers"
        )
        return cls(token, transport_bytes, detail)

    @classmethod
    def index_sharded(
        cls,
        *,
        resident_token_bytes: int,
        index_token_bytes: int,
        index_ranks: int,
        index_buffer_bytes: int,
    ) -> PoolPrice:
        """The index alone sharded by page (D2 without D1): ``1 / N`` of the index, raw K/V whole.

        ``index_ranks`` ranks share the index's pages (every TP rank); the candidate buffers
        are fixed.

        Raises:
            CapacityError: a negative byte count, an index dearer than the whole token, or an
                ``index_ranks`` that is not positive.
        """
        _non_negative("index_buffer_bytes", index_buffer_bytes)
        _positive("index_ranks", index_ranks)
        raw = resident_token_bytes - index_token_bytes
        _non_negative("resident_token_bytes - index_token_bytes", raw)
        token = raw + sharded_token_bytes(0, index_token_bytes, index_ranks, index_sharded=True)
        detail = (
            f"pool sizing charges {token} B per token (was {resident_token_bytes} B: {raw} B of "
            f"raw K/V, {index_token_bytes} B of index over {index_ranks} ranks) plus "
            f"{format_bytes(index_buffer_bytes)} of index candidate buffers"
        )
        return cls(token, index_buffer_bytes, detail)

    @classmethod
    def labelled(
        cls,
        *,
        kv_token_bytes: int,
        label_token_bytes: int,
        offload: OffloadSizes | None = None,
        verify: bool = False,
    ) -> PoolPrice:
        """Double sparsity: a token's label rows beside its K/V, or alone with DS-Offload.

        Args:
            kv_token_bytes: the engine's price of a token's K/V.
            label_token_bytes: its label rows (:func:`label_bytes_per_token`).
            offload: DS-Offload's sizes (its buffers are fixed), or None for resident K/V.
            verify: the offload keeps a resident copy of every row (verification).

        Raises:
            CapacityError: a negative byte count.
        """
        _non_negative("kv_token_bytes", kv_token_bytes)
        _non_negative("label_token_bytes", label_token_bytes)
        kv, labels = kv_token_bytes, label_token_bytes
        parts = f"{kv} B of K/V and {labels} B of labels"
        if offload is None:
            return cls(kv + labels, 0, f"pool sizing charges {kv + labels} B per token ({parts})")
        fixed = offload.fixed_device_bytes(verify=verify)
        mib = fixed / (1 << 20)
        return cls(
            labels,
            fixed,
            f"DS-Offload: pool sizing charges {labels} B per token of labels (was {parts}) plus "
            f"{mib:.1f} MiB {_OFFLOAD_BUFFERS}",
        )
