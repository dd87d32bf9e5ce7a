"""Segment layout inside a checkpoint and the block allocator of the arena. No torch here.

A checkpoint is one logical byte stream: its segments in the order given, each starting at a
multiple of ``align`` bytes. The stream is stored in ``ceil(total / block_bytes)`` arena blocks
that need not be adjacent; :func:`plan_extents` turns a segment into the fewest copies by merging
runs of physically adjacent blocks.

A segment published with ``token_rows`` runs over the checkpoint's tokens along its first
dimension (a layer's K/V, ``[T, H, D]``; a compressed index, ``[T / ratio, H, D]``): the first rows
of a longer checkpoint's segment equal a shorter one's, so a checkpoint that extends a cached
prefix of itself stores only the rows beyond it (:meth:`SegmentSpec.shared_rows`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

from qsa_hostcache._errors import SegmentError


class TensorLike(Protocol):
    """What :meth:`SegmentSpec.like` reads from a tensor (``torch.Tensor`` satisfies it)."""

    @property
    def shape(self) -> tuple[int, ...]: ...  # pragma: no cover

    @property
    def dtype(self) -> object: ...  # pragma: no cover

    def numel(self) -> int: ...  # pragma: no cover

    def element_size(self) -> int: ...  # pragma: no cover


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    """One named part of a checkpoint.

    Attributes:
        name: Unique within a checkpoint (e.g. ``"raw_kv"``, ``"gdn_state"``).
        nbytes: Payload size in bytes (>= 0).
        dtype: Optional dtype name (``str(tensor.dtype)``); restore checks it when set.
        shape: Optional shape; restore checks it when set.
        token_rows: Dimension 0 of ``shape`` runs over the checkpoint's tokens, a fixed number
            of tokens a row (needs ``shape``); a checkpoint extending another then stores only
            the rows the other lacks.
    """

    name: str
    nbytes: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    token_rows: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise SegmentError(f"segment name must be a non-empty string, got {self.name!r}")
        nbytes: object = self.nbytes
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or self.nbytes < 0:
            raise SegmentError(
                f"segment {self.name!r}: nbytes must be an int >= 0, got {self.nbytes!r}"
            )
        if self.token_rows and (not self.shape or (self.shape[0] and self.nbytes % self.shape[0])):
            raise SegmentError(
                f"segment {self.name!r}: token_rows needs a shape whose first dimension divides "
                f"the {self.nbytes!r} bytes into equal rows, got shape {self.shape!r}"
            )

    @classmethod
    def like(cls, name: str, tensor: TensorLike, *, token_rows: bool = False) -> SegmentSpec:
        """The spec of a segment holding exactly ``tensor`` (its bytes, dtype and shape)."""
        return cls(
            name=name,
            nbytes=tensor.numel() * tensor.element_size(),
            dtype=str(tensor.dtype),
            shape=tuple(int(s) for s in tensor.shape),
            token_rows=token_rows,
        )

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along dimension 0 (0 for a segment without rows)."""
        rows = self.shape[0] if self.shape else 0
        return self.nbytes // rows if rows else 0

    def shared_rows(self, num_tokens: int, base: SegmentSpec, base_tokens: int) -> int:
        """How many of this segment's first rows ``base`` already holds (0: none can be shared).

        ``base`` is the same segment of a checkpoint of this one's first ``base_tokens`` tokens
        (this one covers ``num_tokens``). Both must be ``token_rows`` segments of one dtype and
        row shape, with rows in the same proportion to tokens
        (``base_rows / base_tokens == rows / num_tokens``).
        """
        if not (self.token_rows and base.token_rows and self.shape and base.shape):
            return 0
        if base.dtype != self.dtype or base.shape[1:] != self.shape[1:]:
            return 0
        rows, base_rows = self.shape[0], base.shape[0]
        if base_rows * num_tokens != rows * base_tokens or base_rows >= rows:
            return 0
        return base_rows

    def tail(self, rows: int) -> SegmentSpec:
        """The spec of this segment without its first ``rows`` rows (what a checkpoint stores)."""
        if not rows:
            return self
        assert self.shape is not None
        shape = (self.shape[0] - rows, *self.shape[1:])
        return SegmentSpec(
            self.name, self.nbytes - rows * self.row_bytes, self.dtype, shape, self.token_rows
        )


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """Segments of one checkpoint with their byte offsets in its logical stream.

    Attributes:
        segments: The specs, in publish order.
        offsets: Byte offset of each segment, a multiple of ``align``.
        total_bytes: End of the last segment (the stream length; padding included).
        payload_bytes: Sum of the segments' ``nbytes`` (what was published, padding excluded).
    """

    segments: tuple[SegmentSpec, ...]
    offsets: tuple[int, ...]
    total_bytes: int
    payload_bytes: int

    @classmethod
    def plan(cls, segments: tuple[SegmentSpec, ...], align: int) -> CheckpointLayout:
        """Place ``segments`` back to back, each at a multiple of ``align`` bytes.

        Raises:
            SegmentError: No segments, or a name appears twice.
        """
        if not segments:
            raise SegmentError("a checkpoint needs at least one segment, got none")
        names = [s.name for s in segments]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise SegmentError(f"segment names must be unique, repeated: {dup!r}")
        offsets = []
        pos = 0
        for spec in segments:
            pos = -(-pos // align) * align
            offsets.append(pos)
            pos += spec.nbytes
        payload = sum(s.nbytes for s in segments)
        return cls(tuple(segments), tuple(offsets), pos, payload)

    def index(self, name: str) -> int:
        """Position of the segment called ``name``.

        Raises:
            SegmentError: No such segment; the message lists the known names.
        """
        for i, spec in enumerate(self.segments):
            if spec.name == name:
                return i
        raise SegmentError(
            f"checkpoint has no segment {name!r}; its segments are "
            f"{[s.name for s in self.segments]!r}"
        )


Extent = tuple[int, int, int]
"""One copy: ``(arena byte offset, byte offset within the segment, nbytes)``."""


def plan_extents(
    offset: int, nbytes: int, blocks: tuple[int, ...], block_bytes: int
) -> list[Extent]:
    """The copies that move bytes ``[offset, offset+nbytes)`` of a checkpoint's stream.

    Args:
        offset: Start of the segment in the checkpoint's logical stream (bytes).
        nbytes: Segment length (bytes).
        blocks: Arena block ids holding the stream, logical block ``i`` in ``blocks[i]``.
        block_bytes: Bytes per block.

    Returns:
        Extents in segment order; adjacent physical blocks merge into one extent.
    """
    out: list[Extent] = []
    pos = offset
    end = offset + nbytes
    while pos < end:
        lb = pos // block_bytes
        within = pos - lb * block_bytes
        phys = blocks[lb] * block_bytes + within
        run = min(block_bytes - within, end - pos)
        while pos + run < end and blocks[lb + 1] == blocks[lb] + 1:
            lb += 1
            run = min(run + block_bytes, end - pos)
        out.append((phys, pos - offset, run))
        pos += run
    return out


class BlockAllocator:
    """Fixed-size blocks ``0..num_blocks-1``; allocation takes the lowest free ids first.

    Taking the lowest ids keeps a checkpoint's blocks mostly adjacent, so copies stay large even
    after churn. Not thread-safe: the cache calls it under its lock.
    """

    __slots__ = ("_free", "_num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a sorted list is a valid min-heap

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> tuple[int, ...] | None:
        """``count`` free block ids in ascending order, or ``None`` when fewer are free."""
        if count > len(self._free):
            return None
        if count == len(self._free):
            taken = sorted(self._free)
            self._free.clear()
            return tuple(taken)
        return tuple(heapq.heappop(self._free) for _ in range(count))

    def free(self, blocks: tuple[int, ...]) -> None:
        """Return ``blocks`` to the free pool."""
        for block in blocks:
            heapq.heappush(self._free, block)
