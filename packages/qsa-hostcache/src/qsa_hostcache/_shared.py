"""Checkpoints as whole objects in a shared tier: their format, digest, keys and lookup.

One checkpoint is one object, so a restore from the tier is all or nothing. An object is::

    MAGIC (8) | header length (u32 LE) | body length (u64 LE) | xxh3-128 of header+body (16)
    | header (JSON: the key's namespace, page size, page extras; the segments' specs)
    | body (the key's token ids, int64 LE; then each segment's bytes, in header order)

A read checks the lengths and the digest (a corrupt or truncated object is counted and never
used) and then the key material itself, byte for byte, against the query: as in the arena, a
hit needs equal namespace, tokens and page extras, never only equal hashes. The object's name
is built from the key's chained page hash and its page count (only to find candidates) plus a
``scope`` the caller picks (e.g. the weights' version), so a checkpoint of other weights is
never even asked for.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import threading
from collections.abc import Mapping
from typing import Final

import torch
import xxhash

from qsa_core import CountSeries
from qsa_hostcache._errors import CorruptObjectError, StoreUnavailableError
from qsa_hostcache._keys import PrefixKey
from qsa_hostcache._layout import SegmentSpec
from qsa_hostcache._segments import segment_buffer
from qsa_hostcache._tiers import ObjectTier, StoreAddress, TierHealth, open_tier, uninitialised

__all__ = ("SharedCheckpoint", "SharedCheckpoints", "TierStats")

logger = logging.getLogger(__name__)

MAGIC: Final = b"QSAHCv1\x00"
_FRAME: Final = struct.Struct("<8sIQ16s")
_TOKEN_BYTES: Final = 8
#: The body starts at a multiple of this many bytes (the header padded with spaces), so every
#: segment whose predecessors are whole elements of its dtype is read as a view, not a copy.
_BODY_ALIGN: Final = 64


_COUNTER_HELP: Final = {
    "lookups": "Lookups that asked the shared tier (the arena held less than the prompt).",
    "hits": "Lookups the shared tier answered with a verified checkpoint.",
    "hit_tokens": "Prompt tokens of the checkpoints the shared tier answered with.",
    "corrupt": "Objects of the shared tier with a wrong length or digest (never used).",
    "mismatched": "Objects of the shared tier whose key material differed from the query's.",
    "writes": "Checkpoints written through to the shared tier.",
    "puts": "Objects the shared tier's store took.",
    "gets": "Objects read whole from the shared tier's store.",
    "errors": "Calls to the shared tier's store that failed (answered as misses).",
    "unavailable": "Calls answered as misses at once while the shared tier's store was down.",
    "bytes_written": "Bytes of the objects written to the shared tier's store.",
    "bytes_read": "Bytes of the objects read from the shared tier's store.",
}


@dataclasses.dataclass(frozen=True, slots=True)
class TierStats(TierHealth):
    """A shared tier's counters: its store's (the :class:`TierHealth` fields) and its lookups'.

    All are monotonic; bytes are object bytes, tokens prompt tokens.

    Attributes:
        tier: the tier's label (``"mooncake"``).
        lookups: lookups that asked the tier.
        hits: lookups the tier answered with a verified checkpoint.
        hit_tokens: tokens of those checkpoints.
        corrupt: objects found whose lengths or digest were wrong (never used).
        mismatched: objects whose key material differed from the query's (a hash collision).
        writes: checkpoints written to the tier.
    """

    tier: str = ""
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    corrupt: int = 0
    mismatched: int = 0
    writes: int = 0

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @staticmethod
    def series(tier: str) -> tuple[CountSeries, ...]:
        """Every counter, named ``shared_<field>`` and labelled ``tier=<tier>``."""
        return tuple(
            CountSeries(f.name, f"shared_{f.name}", True, _COUNTER_HELP[f.name], ("tier", tier))
            for f in dataclasses.fields(TierStats)
            if f.name != "tier"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class SharedCheckpoint:
    """A checkpoint read back from a shared tier: its key and its segments as CPU tensors."""

    key: PrefixKey
    segments: dict[str, torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return self.key.num_tokens


def object_name(key: PrefixKey, scope: str) -> str:
    """The name of the object holding the checkpoint of ``key`` (whole pages) in ``scope``."""
    chain = key.page_hashes(num_pages=key.num_pages)[key.num_pages - 1]
    ns = xxhash.xxh3_64_hexdigest(key.namespace_material)
    return f"qsa-hostcache/v1/{scope}/{ns}/{key.page_size}/{key.num_pages}/{chain:016x}"


def encode(key: PrefixKey, segments: Mapping[str, torch.Tensor]) -> memoryview:
    """The object of the checkpoint of ``key`` holding ``segments`` (CPU tensors).

    Built in one new buffer: each segment is copied into place once (by torch, which lets
    other threads run meanwhile), and the digest is taken over the buffer itself.
    """
    flats, specs = [], []
    for name, tensor in segments.items():
        spec = SegmentSpec.like(name, tensor)
        specs.append({"name": name, "dtype": spec.dtype, "shape": spec.shape})
        flats.append(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8))
    header = json.dumps(
        {
            "namespace": key.namespace_material.hex(),
            "page_size": key.page_size,
            "extras": {str(i): e.hex() for i, e in sorted(key.page_extras.items())},
            "segments": specs,
        },
        sort_keys=True,
    ).encode()
    header += b" " * (-(_FRAME.size + len(header)) % _BODY_ALIGN)  # JSON ignores the spaces
    tokens = key.token_bytes
    body_len = len(tokens) + sum(flat.numel() for flat in flats)
    out = uninitialised(_FRAME.size + len(header) + body_len)
    at = _FRAME.size + len(header)
    out[_FRAME.size : at] = header
    out[at : at + len(tokens)] = tokens
    at += len(tokens)
    whole = torch.frombuffer(out, dtype=torch.uint8)
    for flat in flats:
        whole[at : at + flat.numel()].copy_(flat)
        at += flat.numel()
    digest = xxhash.xxh3_128(out[_FRAME.size :]).digest()
    _FRAME.pack_into(out, 0, MAGIC, len(header), body_len, digest)
    return out


def decode(data: bytes | bytearray | memoryview, query: PrefixKey) -> SharedCheckpoint | None:
    """The checkpoint in ``data`` if its key material equals ``query``'s, else None.

    Its segments are views of ``data`` where a segment's offset suits its dtype (every segment
    of an object :func:`encode` wrote from element-sized segments), copies elsewhere, so reading
    a checkpoint copies its bytes no more than the tier did. Read-only ``data`` (``bytes``) is
    copied once into a writable buffer first: torch shares only writable memory.

    Raises:
        CorruptObjectError: the frame, a length or the digest is wrong (a truncated or damaged
            object).
    """
    if len(data) < _FRAME.size:
        raise CorruptObjectError(f"object of {len(data)!r} bytes is shorter than its frame")
    magic, header_len, body_len, digest = _FRAME.unpack_from(data)
    if magic != MAGIC:
        raise CorruptObjectError(f"object starts with {magic!r}, not {MAGIC!r}")
    if len(data) != _FRAME.size + header_len + body_len:
        raise CorruptObjectError(
            f"object holds {len(data)!r} bytes; its frame says "
            f"{_FRAME.size + header_len + body_len!r}"
        )
    view = memoryview(data)[_FRAME.size :]
    if xxhash.xxh3_128(view).digest() != digest:
        raise CorruptObjectError("object digest does not match its bytes")
    header = json.loads(bytes(view[:header_len]))
    body = view[header_len:]
    tokens = query.num_tokens * _TOKEN_BYTES
    extras = {str(i): e.hex() for i, e in sorted(query.page_extras.items())}
    if (
        header["namespace"] != query.namespace_material.hex()
        or header["page_size"] != query.page_size
        or header["extras"] != extras
        or body[:tokens] != query.token_bytes
    ):
        return None
    writable = data if not memoryview(data).readonly else bytearray(data)
    whole = torch.frombuffer(writable, dtype=torch.uint8)
    segments = {}
    offset = tokens
    for raw in header["segments"]:
        spec = SegmentSpec(raw["name"], 0, raw["dtype"], tuple(raw["shape"]))
        like = segment_buffer(spec, "meta")
        nbytes = like.numel() * like.element_size()
        if offset + nbytes > len(body):
            raise CorruptObjectError(f"segment {spec.name!r} runs past the object's end")
        start = _FRAME.size + header_len + offset
        raw_bytes = whole[start : start + nbytes]
        if start % like.element_size():
            raw_bytes = raw_bytes.clone()  # an object of another writer: its offset is unaligned
        segments[spec.name] = raw_bytes.view(like.dtype).view(like.shape)
        offset += nbytes
    if offset != len(body):
        raise CorruptObjectError(
            f"object body holds {len(body) - offset!r} bytes past its segments"
        )
    return SharedCheckpoint(query, segments)


class SharedCheckpoints:
    """Checkpoints written through to, and found again in, one :class:`ObjectTier`.

    Args:
        tier: the store.
        scope: a name every object of this cache carries (e.g. ``"w0"`` for the weights'
            version): checkpoints of another scope are never asked for.
    """

    def __init__(self, tier: ObjectTier, *, scope: str = "default") -> None:
        self.tier = tier
        self._scope = scope
        self._lock = threading.Lock()
        self._stats = TierStats(tier=tier.name)

    @classmethod
    def over_store(cls, store: StoreAddress) -> SharedCheckpoints:
        """The shared tier over the store at ``store`` (:func:`open_tier`, its defaults).

        A Mooncake client joins its store on a thread of its own; until then every call misses.

        Raises:
            StoreUnavailableError: the store's client is not installed (the message names the
                extra that installs it).
        """
        try:
            tier = open_tier(store)
        except ImportError as exc:
            msg = (
                f"the shared tier at {str(store)!r} needs Mooncake Store: install "
                f"'qsa-hostcache[mooncake]' ({exc})"
            )
            raise StoreUnavailableError(msg) from None
        return cls(tier)

    @property
    def scope(self) -> str:
        return self._scope

    @scope.setter
    def scope(self, value: str) -> None:
        self._scope = value

    def write(self, key: PrefixKey, segments: Mapping[str, torch.Tensor]) -> bool:
        """Store the checkpoint of ``key`` (whole pages) unless the tier has it; True if stored."""
        stored = self.tier.put(object_name(key, self._scope), encode(key, segments))
        if stored:
            self._count(writes=1)
        return stored

    def lookup(
        self, query: PrefixKey, *, min_pages: int = 1, max_pages: int | None = None
    ) -> SharedCheckpoint | None:
        """The longest checkpoint in the tier that is a prefix of ``query``, read and verified.

        Args:
            query: the prompt's key.
            min_pages: do not look below this many pages (e.g. one more than a RAM hit).
            max_pages: do not look above this many pages (default the query's whole pages).

        Returns:
            The checkpoint (its key is ``query.prefix(pages)``), or None. A corrupt object or
            one of other key material is skipped for the next shorter candidate.
        """
        top = query.num_pages if max_pages is None else min(max_pages, query.num_pages)
        if top < max(min_pages, 1):
            return None
        pages = list(range(top, max(min_pages, 1) - 1, -1))
        names = [object_name(query.prefix(n), self._scope) for n in pages]
        self._count(lookups=1)
        for n, name, present in zip(pages, names, self.tier.contains(names), strict=True):
            if not present:
                continue
            data = self.tier.get(name)
            if data is None:
                continue
            key = query.prefix(n)
            try:
                found = decode(data, key)
            except (CorruptObjectError, ValueError, KeyError, TypeError) as exc:
                self._count(corrupt=1)
                logger.warning("shared tier: object %r is not used: %s", name, exc)
                continue
            if found is None:
                self._count(mismatched=1)
                continue
            self._count(hits=1, hit_tokens=key.num_tokens)
            return found
        return None

    def stats(self) -> TierStats:
        """The tier's counters, its store's included."""
        with self._lock:
            return dataclasses.replace(self._stats, **dataclasses.asdict(self.tier.health()))

    def _count(self, **more: int) -> None:
        with self._lock:
            s = self._stats
            self._stats = dataclasses.replace(
                s, **{name: getattr(s, name) + n for name, n in more.items()}
            )
