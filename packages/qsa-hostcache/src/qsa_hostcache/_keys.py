"""Namespaces and chained page keys.

A checkpoint is identified by its *key material*: the namespace, every token id of the prefix, and
the opaque extra identity of each page that has one. Matching compares that material in full; the
64-bit chained page hashes only find candidates, so a hash collision can cost a lookup but never
produce a false hit.

The chain, for a key with page size ``P`` (tokens are int64, little-endian, ``8·P`` bytes a page)::

    h[-1] = H(namespace material ‖ P as 8 LE bytes, HASH_SEED)
    h[i]  = H(token bytes of page i, h[i-1])
    h[i]  = H(extra identity of page i, h[i] ^ EXTRA_TAG)      only where page i has an extra

where ``H(data, seed)`` is the page hasher (xxh3-64 by default). Seeds are explicit constants, so
every process computes the same keys without a shared ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import hashlib
import json
import reprlib
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NewType, Protocol, cast

import xxhash

from qsa_hostcache._errors import InvalidKeyError

if TYPE_CHECKING:
    import torch

PageHash = NewType("PageHash", int)
"""The chained 64-bit key of one page (an unsigned int below ``2**64``)."""

HASH_SEED: Final = 0x5153_4148_4F53_5443
"""Seed of the namespace hash that starts every chain (ASCII ``QSAHOSTC``)."""

EXTRA_TAG: Final = 0x4558_5452_4149_4445
"""Mixed into the seed of a page's extra-identity hash, so ``b""`` differs from no extra."""

TOKEN_BYTES: Final = 8
"""Bytes per token id in key material (int64, little-endian)."""

_MASK: Final = (1 << 64) - 1
_NS_MAGIC: Final = b"qsa-hostcache/namespace/v1"


class PageHasher(Protocol):
    """A seeded hash of bytes: ``hasher(data, seed) -> int``.

    The default is ``xxhash.xxh3_64_intdigest``. Any callable with this shape works (tests inject a
    deliberately weak one); results are reduced modulo ``2**64``.
    """

    def __call__(self, data: bytes | memoryview, seed: int, /) -> int: ...


DEFAULT_HASHER: Final[PageHasher] = xxhash.xxh3_64_intdigest


def _field(value: str | None) -> bytes:
    if value is None:
        return b"\xff\xff\xff\xff"
    raw = value.encode("utf-8")
    return len(raw).to_bytes(4, "little") + raw


def _canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def config_digest(settings: Mapping[str, object]) -> str:
    """A :attr:`CacheNamespace.config_digest`: SHA-256 (hex) of ``settings`` as canonical JSON.

    Sorted keys, no spaces; a value JSON cannot hold is written as its ``str``. Two engines
    whose settings are equal get the same digest in every process.
    """
    return hashlib.sha256(_canonical_json(settings).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """Everything outside the token ids that must agree for two prefixes to share a checkpoint.

    Attributes:
        model: Model identity (path or name plus revision).
        dtype: Dtype of the cached state as the engine names it (e.g. ``"float8_e4m3fn"``).
        tp_size: Tensor-parallel world size (>= 1).
        tp_rank: This rank, in ``[0, tp_size)``; each rank caches only its own shard.
        config_digest: Digest of the model and runtime configuration that shapes the state.
        salt: Optional cache salt or adapter (LoRA) id; ``None`` and ``""`` are different.
    """

    model: str
    dtype: str
    tp_size: int
    tp_rank: int
    config_digest: str
    salt: str | None = None

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "config_digest", "salt"):
            value = getattr(self, name)
            if value is None and name == "salt":
                continue
            if not isinstance(value, str):
                raise InvalidKeyError(f"{name} must be a string, got {value!r}")
            try:
                encoded = value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidKeyError(
                    f"{name} must be UTF-8 encodable (no lone surrogates), got {value!r}"
                ) from None
            if len(encoded) >= 2**32 - 1:  # a 4-byte length prefix; all ones marks None
                raise InvalidKeyError(
                    f"{name} must encode to fewer than 2**32 - 1 bytes, got {len(encoded)}"
                )
        if not self.model:
            raise InvalidKeyError(f"model must be a non-empty string, got {self.model!r}")
        if not self.dtype:
            raise InvalidKeyError(f"dtype must be a non-empty string, got {self.dtype!r}")
        for name in ("tp_size", "tp_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidKeyError(f"{name} must be an int, got {value!r}")
        if not 1 <= self.tp_size < 2**32:  # encoded in 4 bytes
            raise InvalidKeyError(f"tp_size must lie in [1, 2**32), got {self.tp_size!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidKeyError(
                f"tp_rank must lie in [0, {self.tp_size!r}), got {self.tp_rank!r}"
            )

    @staticmethod
    def model_identity(path: str, revision: str | None = None) -> str:
        """A :attr:`model`: ``path@revision``, or ``path`` where no revision is given (None, "")."""
        return f"{path}@{revision}" if revision else path

    def for_request(
        self,
        *,
        cache_salt: str | None = None,
        lora_id: str | None = None,
        extra_key: str | None = None,
    ) -> CacheNamespace:
        """This namespace with one request's part: its cache salt, adapter (LoRA) and extra key.

        ``salt`` becomes the canonical JSON object of the three
        (``{"cache_salt":...,"extra_key":...,"lora":...}``, sorted keys, no spaces); with all
        three ``None`` the namespace is returned unchanged, so such a request shares the
        engine's keys. ``""`` is a salt, different from ``None``.
        """
        parts = {"cache_salt": cache_salt, "lora": lora_id, "extra_key": extra_key}
        if all(v is None for v in parts.values()):
            return self
        return dataclasses.replace(self, salt=_canonical_json(parts))

    def material(self) -> bytes:
        """Canonical, length-prefixed encoding of every field (the bytes a match compares)."""
        return b"".join(
            (
                _NS_MAGIC,
                _field(self.model),
                _field(self.dtype),
                self.tp_size.to_bytes(4, "little"),
                self.tp_rank.to_bytes(4, "little"),
                _field(self.config_digest),
                _field(self.salt),
            )
        )


def _tensor_token_bytes(tokens: torch.Tensor) -> bytes:
    if tokens.dim() != 1:
        raise InvalidKeyError(f"token tensor must be 1-D [T], got shape {tuple(tokens.shape)!r}")
    if tokens.is_floating_point() or tokens.is_complex() or str(tokens.dtype) == "torch.bool":
        raise InvalidKeyError(f"token tensor must have an integer dtype, got {tokens.dtype!r}")
    flat = tokens.detach().cpu().contiguous()
    if str(flat.dtype) == "torch.uint64":  # ids >= 2**63 would wrap to negative int64 ids
        import torch  # only tensors get here; keys import without torch

        as_signed = flat.view(torch.int64)
        if bool((as_signed < 0).any()):
            first = int(torch.nonzero(as_signed < 0)[0, 0])
            raise InvalidKeyError(
                f"token id {int(as_signed[first]) + 2**64!r} at index {first!r} is outside the "
                f"int64 range [0, 2**63)"
            )
        flat = as_signed
    flat = flat.long()
    raw = ctypes.string_at(flat.data_ptr(), flat.numel() * TOKEN_BYTES)
    return raw if sys.byteorder == "little" else _swap(raw)


def _swap(raw: bytes) -> bytes:
    arr = array.array("q")
    arr.frombytes(raw)
    arr.byteswap()
    return arr.tobytes()


_INT_FORMATS: Final = frozenset("bBhHiIlLqQnN")


def token_bytes(tokens: object) -> bytes:
    """Encode token ids as key material: int64, little-endian, ``8·T`` bytes.

    Args:
        tokens: ``[T]`` token ids as a sequence of ints, an integer ``array.array``, any 1-D
            integer buffer (e.g. a NumPy array), or a 1-D integer ``torch.Tensor`` on any device.

    Returns:
        The ids as bytes; ``T`` ids give ``8·T`` bytes.

    Raises:
        InvalidKeyError: Not 1-D, not integer, or an id outside the int64 range.
    """
    if hasattr(tokens, "data_ptr") and hasattr(tokens, "dtype"):
        return _tensor_token_bytes(tokens)  # type: ignore[arg-type]
    if isinstance(tokens, (bytes, bytearray, str)):
        raise InvalidKeyError(
            f"tokens must be integer ids, not {type(tokens).__name__!r} {reprlib.repr(tokens)}; "
            f"wrap raw int64 bytes in array.array('q')"
        )
    try:
        view = memoryview(tokens)  # type: ignore[arg-type]
    except TypeError:
        view = None
    if view is not None:
        if view.ndim != 1 or view.format.lstrip("@=<>!") not in _INT_FORMATS:
            raise InvalidKeyError(
                f"token buffer must be 1-D integer, got ndim={view.ndim!r} format={view.format!r}"
            )
        fmt = view.format.lstrip("@=")
        if fmt in ("q", "l", "n") and view.itemsize == TOKEN_BYTES and view.c_contiguous:
            raw = view.cast("B").tobytes()
            return raw if sys.byteorder == "little" else _swap(raw)
        ids: Iterable[int]
        if fmt[:1] in ("<", ">", "!"):  # an explicit byte order (e.g. NumPy '>i8'): decode it
            ids = [value for (value,) in struct.iter_unpack(fmt, view.tobytes())]
        else:
            ids = view.tolist()
    elif isinstance(tokens, Iterable):
        ids = tokens
    else:
        raise InvalidKeyError(
            f"tokens must be a sequence of ints, got {tokens!r} ({type(tokens).__name__})"
        )
    if not isinstance(ids, (list, tuple)):  # an iterator is read twice if array() refuses it
        ids = list(ids)
    try:
        arr = array.array("q", ids)
    except (TypeError, OverflowError) as exc:
        position, bad = next(
            (i, t) for i, t in enumerate(ids) if not _is_int64(t)
        )  # array() refused one: name it
        raise InvalidKeyError(
            f"token ids must be ints in the int64 range; tokens[{position}]={bad!r}"
        ) from exc
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _is_int64(value: object) -> bool:
    """Whether ``array('q')`` takes ``value``: an int (or ``__index__``) in the int64 range."""
    try:
        array.array("q", [cast("int", value)])  # array() itself checks the value
    except (TypeError, OverflowError):
        return False
    return True


class PrefixKey:
    """The key material of a token prefix, with its chained page hashes computed on demand.

    Only complete pages take part in matching: a key of ``T`` tokens has ``T // page_size`` pages,
    and the 0..page_size-1 trailing tokens are kept but never matched. Instances are immutable;
    page hashes are memoized per hasher, and :meth:`prefix` shares them. A key may be shared by
    threads: a memoized chain is never changed in place, only replaced by a longer copy.

    Args:
        namespace: Where this prefix lives; keys of different namespaces never match.
        tokens: ``[T]`` token ids (see :func:`token_bytes` for the accepted forms).
        page_size: Tokens per page (>= 1); the cache's page size must be the same.
        page_extras: Opaque extra identity per page (e.g. image keys of the images a page
            touches): a mapping ``page index -> bytes`` or a sequence with ``None`` for pages that
            have none. Indices lie in ``[0, ceil(T / page_size))``.
    """

    __slots__ = ("_extras", "_hashes", "_namespace", "_ns_material", "_page_size", "_tokens")

    def __init__(
        self,
        namespace: CacheNamespace,
        tokens: object,
        *,
        page_size: int = 64,
        page_extras: Mapping[int, bytes] | Sequence[bytes | None] | None = None,
    ) -> None:
        given: object = page_size
        if not isinstance(given, int) or isinstance(given, bool) or page_size < 1:
            raise InvalidKeyError(f"page_size must be an int >= 1, got {page_size!r}")
        raw = token_bytes(tokens)
        self._namespace = namespace
        self._ns_material = namespace.material()
        self._page_size = page_size
        self._tokens = raw
        self._extras = _normalise_extras(page_extras, len(raw) // TOKEN_BYTES, page_size)
        self._hashes: dict[PageHasher, list[int]] = {}

    @classmethod
    def _from_parts(  # noqa: PLR0917 (private constructor, every part is required)
        cls,
        namespace: CacheNamespace,
        ns_material: bytes,
        page_size: int,
        tokens: bytes,
        extras: dict[int, bytes],
        hashes: dict[PageHasher, list[int]],
    ) -> PrefixKey:
        key = cls.__new__(cls)
        key._namespace = namespace
        key._ns_material = ns_material
        key._page_size = page_size
        key._tokens = tokens
        key._extras = extras
        key._hashes = hashes
        return key

    @property
    def namespace(self) -> CacheNamespace:
        return self._namespace

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_tokens(self) -> int:
        """All tokens given, including a trailing partial page."""
        return len(self._tokens) // TOKEN_BYTES

    @property
    def num_pages(self) -> int:
        """Complete pages: ``num_tokens // page_size``."""
        return len(self._tokens) // (TOKEN_BYTES * self._page_size)

    @property
    def token_bytes(self) -> bytes:
        """The token ids as int64 little-endian bytes (``8·num_tokens`` bytes)."""
        return self._tokens

    @property
    def namespace_material(self) -> bytes:
        return self._ns_material

    @property
    def page_extras(self) -> Mapping[int, bytes]:
        """Page index -> extra identity, for the pages that have one."""
        return dict(self._extras)

    def prefix(self, num_pages: int) -> PrefixKey:
        """The key of the first ``num_pages`` complete pages (shares memoized hashes).

        Raises:
            InvalidKeyError: ``num_pages`` outside ``[0, self.num_pages]``.
        """
        if not 0 <= num_pages <= self.num_pages:
            raise InvalidKeyError(
                f"num_pages must lie in [0, {self.num_pages!r}], got {num_pages!r}"
            )
        stop = num_pages * self._page_size * TOKEN_BYTES
        extras = {i: e for i, e in self._extras.items() if i < num_pages}
        return PrefixKey._from_parts(
            self._namespace,
            self._ns_material,
            self._page_size,
            self._tokens[:stop],
            extras,
            self._hashes,
        )

    def chain_seed(self, hasher: PageHasher = DEFAULT_HASHER) -> int:
        """``h[-1]``: the hash of the namespace material and page size that starts the chain."""
        material = self._ns_material + self._page_size.to_bytes(8, "little")
        return hasher(material, HASH_SEED) & _MASK

    def page_hashes(
        self, hasher: PageHasher = DEFAULT_HASHER, num_pages: int | None = None
    ) -> Sequence[PageHash]:
        """Chained keys of the first ``num_pages`` pages (default all), memoized per hasher.

        The returned sequence may be longer than ``num_pages`` when more were computed before;
        index it, do not rely on its length.
        """
        want = self.num_pages if num_pages is None else min(num_pages, self.num_pages)
        done = self._hashes.get(hasher, [])
        if len(done) < want:
            longer = self._extended_chain(hasher, done, want)
            # Publish the copy (one dict store); a thread that published a longer one first
            # keeps it, and either is a correct prefix of the chain.
            if len(self._hashes.get(hasher, ())) < len(longer):
                self._hashes[hasher] = longer
            done = longer
        return done  # type: ignore[return-value]

    def _extended_chain(self, hasher: PageHasher, done: list[int], want: int) -> list[int]:
        """A new list: ``done`` followed by the chain's pages ``len(done) .. want - 1``."""
        step = self._page_size * TOKEN_BYTES
        view = memoryview(self._tokens)
        h = done[-1] if done else self.chain_seed(hasher)
        chain = list(done)
        append = chain.append
        start = len(done)
        extras = self._extras
        if hasher is DEFAULT_HASHER and not extras:
            # The hot path: one xxh3 call per page, no masking (xxh3 is already 64-bit).
            for off in range(start * step, want * step, step):
                h = hasher(view[off : off + step], h)
                append(h)
            return chain
        for page in range(start, want):
            off = page * step
            h = hasher(view[off : off + step], h) & _MASK
            extra = extras.get(page)
            if extra is not None:
                h = hasher(extra, h ^ EXTRA_TAG) & _MASK
            append(h)
        return chain

    def __repr__(self) -> str:
        return (
            f"PrefixKey(model={self._namespace.model!r}, tp_rank={self._namespace.tp_rank!r}, "
            f"num_tokens={self.num_tokens!r}, page_size={self._page_size!r}, "
            f"pages_with_extras={len(self._extras)!r})"
        )


def _normalise_extras(
    extras: Mapping[int, bytes] | Sequence[bytes | None] | None, num_tokens: int, page_size: int
) -> dict[int, bytes]:
    if extras is None:
        return {}
    limit = -(-num_tokens // page_size)
    items: Iterable[tuple[int, bytes | None]]
    given: object = extras
    if isinstance(extras, Mapping):
        items = extras.items()
    elif isinstance(given, (bytes, bytearray, str)):
        raise InvalidKeyError("page_extras must be a mapping or a sequence, not a bytes object")
    else:
        items = enumerate(extras)
    out: dict[int, bytes] = {}
    for page, extra in items:
        if extra is None:
            continue
        index: object = page
        if not isinstance(index, int) or not 0 <= page < limit:
            raise InvalidKeyError(
                f"page_extras index must be an int in [0, {limit!r}) for {num_tokens!r} tokens "
                f"of page size {page_size!r}, got {page!r}"
            )
        value: object = extra
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidKeyError(
                f"page_extras[{page!r}] must be bytes, got {type(extra).__name__!r}"
            )
        out[page] = bytes(extra)
    return out


def page_keys(
    key: PrefixKey, hasher: PageHasher = DEFAULT_HASHER, num_pages: int | None = None
) -> tuple[PageHash, ...]:
    """The chained page keys of ``key`` as a tuple (``num_pages`` of them, default all)."""
    want = key.num_pages if num_pages is None else num_pages
    if not 0 <= want <= key.num_pages:
        raise InvalidKeyError(f"num_pages must lie in [0, {key.num_pages!r}], got {want!r}")
    return tuple(key.page_hashes(hasher, want)[:want])
