"""Placement of the QSA caches across a shard group of ``N`` ranks.

Raw K/V is **token-interleaved**: logical slot ``g`` lives on rank ``g % N`` at local slot
``g // N``. The compressed index is **page-interleaved**: compressed page ``p`` (``blocks_per_page``
consecutive blocks, one KV page's worth) lives on rank ``p % N`` at local page ``p // N``, so all
blocks of a page share one owner. The allocator sees a widened logical slot space of
``local_capacity × N`` raw slots; every rank stores only its ``local_capacity``. The pending ring
stays replicated (a group may close before its page owner matters).

Every mapping has an exact inverse: ``to_global(owner(g), to_local(g)) == g`` for every slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from qsa_core._checks import is_int
from qsa_core._errors import PlacementError
from qsa_core._profile import QSAProfile

__all__ = ("ShardPlacement",)

#: Replica groups up to this size have their allowed shard sizes listed in a refusal.
_LISTED_REPLICAS = 1024


def _check_nonneg(name: str, value: int) -> None:
    if not is_int(value) or value < 0:
        msg = f"{name}={value!r} is not allowed; it must be an integer >= 0"
        raise PlacementError(msg)


@dataclass(frozen=True, slots=True)
class ShardPlacement:
    """Owner rank and local index of raw slots and compressed blocks in a shard group.

    Attributes:
        world_size: ranks in the shard group (``N >= 1``).
        blocks_per_page: blocks per compressed page (``page_size // compress_ratio``; 16 for
            Qwen3.8-Flash-Next).
        compress_ratio: tokens per block (4).
    """

    world_size: int
    blocks_per_page: int
    compress_ratio: int

    def __post_init__(self) -> None:
        for name in ("world_size", "blocks_per_page", "compress_ratio"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                msg = f"{name}={value!r} is not allowed; it must be a positive integer"
                raise PlacementError(msg)

    @classmethod
    def for_tp(
        cls,
        profile: QSAProfile,
        tp_size: int,
        sharding_size: int,
        *,
        attn_cp_size: int = 1,
    ) -> ShardPlacement:
        """The placement of a shard group inside a TP group, validated as upstream.

        The group must lie inside one KV-head replica group (:meth:`kv_replica_ranks`):
        ``sharding_size`` divides the number of TP ranks holding copies of the same KV head.

        Args:
            profile: the model's QSA profile.
            tp_size: the TP size.
            sharding_size: ranks per shard group.
            attn_cp_size: attention context parallelism over the TP group (SGLang's CP-TP group
                sharing, ``--attn-cp-size == --tp-size``: attention TP 1, so every rank holds
                every KV head); 1 without it.

        Raises:
            PlacementError: the sizes do not satisfy those rules (the message lists the allowed
                sharding sizes), or ``attn_cp_size`` is neither 1 nor ``tp_size``.
        """
        replicas = cls.kv_replica_ranks(profile, tp_size, attn_cp_size=attn_cp_size)
        if not (is_int(sharding_size) and 1 <= sharding_size <= replicas) or (
            replicas % sharding_size
        ):
            # The divisors, listed where a reader can use the list (any TP size is accepted).
            allowed: object = (
                [n for n in range(1, replicas + 1) if replicas % n == 0]
                if replicas <= _LISTED_REPLICAS
                else f"the divisors of {replicas}"
            )
            cp = f", attn_cp_size={attn_cp_size!r}" if attn_cp_size != 1 else ""
            msg = (
                f"sharding_size={sharding_size!r} is not allowed at tp_size={tp_size!r}{cp} "
                f"with num_kv_heads={profile.num_kv_heads!r}; allowed: {allowed!r} (the shard "
                "group must lie inside one KV-head replica group)"
            )
            raise PlacementError(msg)
        return cls(sharding_size, profile.blocks_per_page, profile.compress_ratio)

    @staticmethod
    def kv_replica_ranks(profile: QSAProfile, tp_size: int, *, attn_cp_size: int = 1) -> int:
        """TP ranks that hold a copy of the same KV head.

        ``max(1, tp_size // num_kv_heads)`` with the heads split over TP; ``tp_size`` under
        attention CP over the TP group (``attn_cp_size == tp_size``: every rank holds every
        head).

        Raises:
            PlacementError: ``attn_cp_size`` is neither 1 nor ``tp_size``.
            QSAConfigError: ``tp_size`` does not split the KV heads.
        """
        if not is_int(attn_cp_size) or attn_cp_size not in (1, tp_size):
            msg = (
                f"attn_cp_size={attn_cp_size!r} is not allowed at tp_size={tp_size!r}; allowed: "
                f"1 or {tp_size!r} (attention CP over the whole TP group)"
            )
            raise PlacementError(msg)
        if attn_cp_size > 1:
            return tp_size
        return profile.kv_replicas(tp_size)

    @staticmethod
    def tp_groups(
        profile: QSAProfile, tp_size: int, sharding_size: int, *, attn_cp_size: int = 1
    ) -> tuple[tuple[int, ...], ...]:
        """The TP ranks of every shard group, each in rank order, the groups in rank order.

        TP rank ``r`` holds K/V head ``r // replicas`` (``replicas = kv_replicas(tp_size)``,
        the order in which SGLang's QKV projection replicates heads), so each head's replica
        group is ``replicas`` consecutive ranks; it is cut into runs of ``sharding_size``. Under
        attention CP over the TP group every rank holds every head: one replica group of all
        ranks. Every rank builds the same list, so every rank can create every group in the same
        order.

        Raises:
            PlacementError: as :meth:`for_tp`.
        """
        placement = ShardPlacement.for_tp(
            profile, tp_size, sharding_size, attn_cp_size=attn_cp_size
        )
        n = placement.world_size
        # ``n`` divides ``replicas``: runs of ``n`` never straddle two replica groups.
        return tuple(tuple(range(start, start + n)) for start in range(0, tp_size, n))

    # ----------------------------------------------------------------- raw K/V (token-interleaved)

    def raw_owner(self, slot: int) -> int:
        """Rank that stores logical raw slot ``slot``: ``slot % N``."""
        _check_nonneg("slot", slot)
        return slot % self.world_size

    def raw_local(self, slot: int) -> int:
        """Local slot on the owner: ``slot // N``."""
        _check_nonneg("slot", slot)
        return slot // self.world_size

    def raw_global(self, rank: int, local_slot: int) -> int:
        """Logical slot of ``local_slot`` on ``rank``: ``local_slot × N + rank``."""
        self._check_rank(rank)
        _check_nonneg("local_slot", local_slot)
        return local_slot * self.world_size + rank

    # ------------------------------------------------------------ compressed (page-interleaved)

    def block_of_slot(self, slot: int) -> int:
        """Compressed block (slot) of logical raw slot ``slot``: ``slot // compress_ratio``."""
        _check_nonneg("slot", slot)
        return slot // self.compress_ratio

    def page_owner(self, page: int) -> int:
        """Rank that stores compressed page ``page``: ``page % N``."""
        _check_nonneg("page", page)
        return page % self.world_size

    def block_owner(self, block: int) -> int:
        """Rank that stores compressed block ``block`` (its page's owner)."""
        _check_nonneg("block", block)
        return (block // self.blocks_per_page) % self.world_size

    def block_local(self, block: int) -> int:
        """Local block index on the owner (local page × blocks per page + offset in page)."""
        _check_nonneg("block", block)
        page, offset = divmod(block, self.blocks_per_page)
        return (page // self.world_size) * self.blocks_per_page + offset

    def block_global(self, rank: int, local_block: int) -> int:
        """Logical block of ``local_block`` on ``rank``."""
        self._check_rank(rank)
        _check_nonneg("local_block", local_block)
        local_page, offset = divmod(local_block, self.blocks_per_page)
        return (local_page * self.world_size + rank) * self.blocks_per_page + offset

    # ----------------------------------------------------------------- capacity

    def logical_capacity(self, local_capacity: int) -> int:
        """Raw slots the allocator sees when each rank stores ``local_capacity``: × ``N``."""
        _check_nonneg("local_capacity", local_capacity)
        return local_capacity * self.world_size

    def local_capacity(self, logical_capacity: int) -> int:
        """Raw slots each rank must store for ``logical_capacity`` logical slots (ceil)."""
        _check_nonneg("logical_capacity", logical_capacity)
        return -(-logical_capacity // self.world_size)

    def raw_slots_on_rank(self, num_slots: int, rank: int) -> int:
        """How many of the logical slots ``[0, num_slots)`` rank ``rank`` stores."""
        _check_nonneg("num_slots", num_slots)
        self._check_rank(rank)
        return (num_slots - rank + self.world_size - 1) // self.world_size

    def blocks_on_rank(self, num_blocks: int, rank: int) -> int:
        """How many of the logical blocks ``[0, num_blocks)`` rank ``rank`` stores."""
        _check_nonneg("num_blocks", num_blocks)
        self._check_rank(rank)
        full_pages, tail = divmod(num_blocks, self.blocks_per_page)
        pages = (full_pages - rank + self.world_size - 1) // self.world_size
        count = pages * self.blocks_per_page
        if tail and full_pages % self.world_size == rank:
            count += tail
        return count

    def bytes_per_rank(self, logical_capacity: int, bytes_per_slot: int) -> int:
        """Bytes each rank allocates for ``logical_capacity`` raw slots of ``bytes_per_slot``."""
        _check_nonneg("bytes_per_slot", bytes_per_slot)
        return self.local_capacity(logical_capacity) * bytes_per_slot

    def _check_rank(self, rank: int) -> None:
        if not is_int(rank) or not 0 <= rank < self.world_size:
            msg = f"rank={rank!r} is not allowed; allowed: 0..{self.world_size - 1}"
            raise PlacementError(msg)
