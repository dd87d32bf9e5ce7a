"""A rank's handle on its QSA shard group, and the two flat collectives the sharded path uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from qsa_core import QSAProfile, ShardPlacement
from qsa_kernels._errors import KernelInputError
from qsa_kernels._path import KernelPath

__all__ = (
    "KernelPath",
    "ShardGroup",
    "all_gather_flat",
    "all_gather_rows",
    "all_to_all_flat",
    "group_row_counts",
)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardGroup:
    """One rank's view of a QSA shard group.

    Attributes:
        placement: owner and local index of raw slots and compressed pages
            (``placement.world_size`` ranks).
        rank: this rank's index inside the shard group, ``0 <= rank < world_size``.
        group: the torch.distributed process group of exactly those ranks, in rank order;
            ``None`` means the default group. Unused (and ``torch.distributed`` need not be
            initialised) when ``world_size == 1``.
    """

    placement: ShardPlacement
    rank: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        world = self.placement.world_size
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            msg = f"rank={self.rank!r} must be an int in 0..{world - 1}"
            raise KernelInputError(msg)
        if not 0 <= self.rank < world:
            msg = f"rank={self.rank!r} is not allowed; allowed: 0..{world - 1}"
            raise KernelInputError(msg)
        if world == 1:
            return
        if not dist.is_initialized():
            msg = f"world_size={world!r} > 1 needs an initialised torch.distributed process group"
            raise KernelInputError(msg)
        group_size = dist.get_world_size(self.group)
        group_rank = dist.get_rank(self.group)
        if group_size != world or group_rank != self.rank:
            msg = (
                f"process group has size {group_size!r} and this rank is {group_rank!r}; the "
                f"placement says world_size={world!r}, rank={self.rank!r}"
            )
            raise KernelInputError(msg)

    @classmethod
    def from_process_group(
        cls,
        group: dist.ProcessGroup | None = None,
        *,
        blocks_per_page: int = 16,
        compress_ratio: int = 4,
    ) -> ShardGroup:
        """The shard group of every rank of ``group`` (default: the default group)."""
        world = dist.get_world_size(group)
        placement = ShardPlacement(world, blocks_per_page, compress_ratio)
        return cls(placement, dist.get_rank(group), group)

    @classmethod
    def join_tp(
        cls,
        profile: QSAProfile,
        tp_ranks: Sequence[int],
        tp_rank: int,
        sharding_size: int,
        *,
        attn_cp_size: int = 1,
    ) -> ShardGroup | None:
        """This TP rank's shard group of ``sharding_size`` ranks, or None when it is 1.

        Every rank of the TP group must call it alike: it creates every group of
        :meth:`qsa_core.ShardPlacement.tp_groups` in that order (``torch.distributed.new_group``
        is collective over the default group, with its backend) and keeps its own.

        Args:
            profile: the model's QSA profile (its K/V heads and page geometry).
            tp_ranks: the default group's rank of each TP rank, in TP order.
            tp_rank: this rank's index in ``tp_ranks``.
            sharding_size: ranks that store one K/V head's raw K/V once.
            attn_cp_size: attention CP over the TP group (every rank holds every head).

        Raises:
            qsa_core.PlacementError: ``sharding_size`` does not fit ``len(tp_ranks)``.
            KernelInputError: ``tp_rank`` is not an index of ``tp_ranks``.
        """
        if sharding_size == 1:
            return None
        size = len(tp_ranks)
        given: object = tp_rank  # callers without a type checker
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < size:
            msg = f"tp_rank={tp_rank!r} is not allowed; allowed: 0..{size - 1}"
            raise KernelInputError(msg)
        placement = ShardPlacement.for_tp(profile, size, sharding_size, attn_cp_size=attn_cp_size)
        mine: ShardGroup | None = None
        for members in ShardPlacement.tp_groups(
            profile, size, sharding_size, attn_cp_size=attn_cp_size
        ):
            group = dist.new_group([tp_ranks[i] for i in members])
            if tp_rank in members and isinstance(group, dist.ProcessGroup):
                mine = cls(placement, members.index(tp_rank), group)
        assert mine is not None  # tp_groups covers every rank
        return mine

    @classmethod
    def join_index_tp(
        cls, tp_ranks: Sequence[int], tp_rank: int, *, blocks_per_page: int, compress_ratio: int
    ) -> ShardGroup:
        """This TP rank's group for the compressed index alone (D2 without D1): every TP rank.

        The index has no head split (one key head, computed on every TP rank), so its pages
        can be shared by the whole TP group whatever the K/V heads are. Every rank of the TP
        group must call it alike (``torch.distributed.new_group`` is collective over the default
        group).

        Raises:
            KernelInputError: ``tp_rank`` is not an index of ``tp_ranks``.
        """
        size = len(tp_ranks)
        given: object = tp_rank  # callers without a type checker
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < size:
            msg = f"tp_rank={tp_rank!r} is not allowed; allowed: 0..{size - 1}"
            raise KernelInputError(msg)
        placement = ShardPlacement(size, blocks_per_page, compress_ratio)
        group = dist.new_group(list(tp_ranks)) if size > 1 else None
        return cls(placement, tp_rank, group if isinstance(group, dist.ProcessGroup) else None)

    @property
    def world_size(self) -> int:
        """Ranks in the shard group."""
        return self.placement.world_size


def _check_flat(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        msg = f"{name} must be a contiguous 1-D buffer view; got shape {tuple(t.shape)!r}"
        raise KernelInputError(msg)


def all_gather_flat(shard: ShardGroup, send: torch.Tensor, recv: torch.Tensor) -> None:
    """All-gather ``send`` ``[n]`` from every rank into ``recv`` ``[world * n]``, rank-major.

    One collective (none when ``world_size == 1``: a copy). Both are contiguous 1-D views of
    static buffers, so the call is CUDA-graph capturable with NCCL.
    """
    _check_flat("send", send)
    _check_flat("recv", recv)
    if recv.numel() != send.numel() * shard.world_size or recv.dtype != send.dtype:
        msg = (
            f"recv must hold world_size={shard.world_size!r} x {send.numel()!r} {send.dtype!r}; "
            f"got {recv.numel()!r} {recv.dtype!r}"
        )
        raise KernelInputError(msg)
    if shard.world_size == 1:
        recv.copy_(send)
        return
    gather = getattr(dist, "all_gather_single", None)  # newer torch; the older name warns there
    if gather is None:
        gather = dist.all_gather_into_tensor
    gather(recv, send, group=shard.group)


def group_row_counts(shard: ShardGroup, rows: int, device: torch.device) -> tuple[int, ...]:
    """Every rank's ``rows``, in rank order: one all-gather of an int64 and a host read.

    Not capturable (the counts come back to the host); for eager steps whose ranks bring
    different numbers of rows (a context-parallel prefill's zigzag rows).
    """
    if shard.world_size == 1:
        return (rows,)
    send = torch.tensor([rows], dtype=torch.int64, device=device)
    recv = torch.empty(shard.world_size, dtype=torch.int64, device=device)
    all_gather_flat(shard, send, recv)
    return tuple(int(n) for n in recv.tolist())


def all_gather_rows(shard: ShardGroup, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Every rank's ``rows``, concatenated in rank order, on every rank.

    One all-gather of the rows padded to ``max(counts)``, moved as bytes (any dtype, fp8 and
    bf16 included, over any backend).

    Args:
        shard: this rank's shard group.
        rows: ``[counts[rank], ...]`` this rank's rows; the trailing shape and dtype are the
            same on every rank.
        counts: every rank's row count (:func:`group_row_counts`), the same on every rank.

    Returns:
        ``[sum(counts), ...]`` ``rows.dtype``: rank 0's rows, then rank 1's, ...

    Raises:
        KernelInputError: ``counts`` is not one count per rank, or this rank's is not
            ``rows.shape[0]``.
    """
    if len(counts) != shard.world_size or counts[shard.rank] != rows.shape[0]:
        msg = (
            f"counts must give world_size={shard.world_size!r} ranks' rows with this rank's "
            f"{rows.shape[0]!r} at {shard.rank!r}; got {list(counts)!r}"
        )
        raise KernelInputError(msg)
    width = max(counts)
    if shard.world_size == 1 or width == 0:
        return rows
    padded = rows.new_zeros((width, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    send = padded.reshape(width, -1).view(torch.uint8).reshape(-1)
    recv = torch.empty(shard.world_size * send.numel(), dtype=torch.uint8, device=rows.device)
    all_gather_flat(shard, send, recv)
    per_rank = recv.view(shard.world_size, width, -1)
    parts = [per_rank[rank, :n] for rank, n in enumerate(counts)]
    gathered = torch.cat(parts).view(rows.dtype)
    return gathered.reshape(sum(counts), *rows.shape[1:])


def all_to_all_flat(shard: ShardGroup, send: torch.Tensor, recv: torch.Tensor) -> None:
    """All-to-all of equal chunks: chunk ``j`` of ``send`` goes to rank ``j``'s chunk ``rank``.

    ``send`` and ``recv`` are contiguous 1-D ``[world * n]`` views; one collective (a copy when
    ``world_size == 1``).
    """
    _check_flat("send", send)
    _check_flat("recv", recv)
    if recv.numel() != send.numel() or send.numel() % shard.world_size or recv.dtype != send.dtype:
        msg = (
            f"send and recv must be equal [world_size={shard.world_size!r} x n] buffers; got "
            f"{send.numel()!r} {send.dtype!r} and {recv.numel()!r} {recv.dtype!r}"
        )
        raise KernelInputError(msg)
    if shard.world_size == 1:
        recv.copy_(send)
        return
    dist.all_to_all_single(recv, send, group=shard.group)
