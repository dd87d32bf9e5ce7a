"""Canonical, versioned, length-prefixed encoding of key fields, and the hashes over it.

Every field is written as a one-byte tag followed by its payload; variable-size payloads (text,
bytes, integers, sequences, mappings) carry their size as a little-endian ``u64`` first. The
encoding is therefore prefix-free: no choice of field values can shift a boundary and make two
different field lists encode to the same bytes. Each encoded record starts with a domain string
that names what it is and the encoding version, so records of different kinds never coincide.

The hashes are XXH3-128 with explicit 64-bit seeds: the same input gives the same 16 bytes in every
process, on every host, whatever ``PYTHONHASHSEED`` is.
"""

from __future__ import annotations

import numbers
import struct
from collections.abc import Mapping, Sequence
from typing import Final, TypeAlias

import xxhash

from qsa_mm_prefix._errors import UnsupportedArgumentError

ENCODING_VERSION: Final[int] = 1
"""Version of the field encoding; bump it whenever any record's layout changes."""

KEY_BYTES: Final[int] = 16
"""Size in bytes of every key and digest this package produces (XXH3-128)."""

CONTENT_SEED: Final[int] = 0x51534D4D_434F4E54
"""XXH3-128 seed for content digests (the ASCII bytes ``QSMMCONT``)."""

FIELD_SEED: Final[int] = 0x51534D4D_4B455953
"""XXH3-128 seed for digests of encoded field records (the ASCII bytes ``QSMMKEYS``)."""

_MAX_DEPTH: Final[int] = 32

PreprocessArg: TypeAlias = "bool | int | float | str | bytes | Sequence[PreprocessArg] | Mapping[str, PreprocessArg] | None"  # noqa: E501
"""A preprocessing argument value: scalars, sequences and string-keyed mappings of them."""

_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")


# One-byte field tags. Fixed forever for ENCODING_VERSION 1.
_NONE = b"\x00"
_FALSE = b"\x01"
_TRUE = b"\x02"
_INT = b"\x03"
_FLOAT = b"\x04"
_STR = b"\x05"
_BYTES = b"\x06"
_SEQ = b"\x07"
_MAP = b"\x08"


class Packer:
    """Builds one encoded record: a domain string, then tagged, length-prefixed fields."""

    __slots__ = ("_parts",)

    def __init__(self, domain: str) -> None:
        self._parts: list[bytes] = []
        self.text(f"qsa-mm-prefix/{domain}/v{ENCODING_VERSION}")

    def none(self) -> Packer:
        self._parts.append(_NONE)
        return self

    def boolean(self, value: bool) -> Packer:
        self._parts.append(_TRUE if value else _FALSE)
        return self

    def integer(self, value: int) -> Packer:
        size = (value.bit_length() + 8) // 8
        self._parts.append(_INT + _U64.pack(size))
        self._parts.append(value.to_bytes(size, "little", signed=True))
        return self

    def real(self, value: float) -> Packer:
        self._parts.append(_FLOAT + _F64.pack(value))
        return self

    def text(self, value: str) -> Packer:
        raw = value.encode("utf-8", "surrogatepass")
        self._parts.append(_STR + _U64.pack(len(raw)))
        self._parts.append(raw)
        return self

    def blob(self, value: bytes) -> Packer:
        self._parts.append(_BYTES + _U64.pack(len(value)))
        self._parts.append(bytes(value))
        return self

    def sequence_header(self, count: int) -> Packer:
        self._parts.append(_SEQ + _U64.pack(count))
        return self

    def integers(self, values: Sequence[int]) -> Packer:
        self.sequence_header(len(values))
        for value in values:
            self.integer(value)
        return self

    def optional_integers(self, values: Sequence[int] | None) -> Packer:
        return self.none() if values is None else self.integers(values)

    def argument(self, value: object, path: str = "args", depth: int = 0) -> Packer:
        """Append one preprocessing argument value in canonical form.

        Raises:
            UnsupportedArgumentError: ``value`` (at ``path``) is not a supported type, or nests
                deeper than 32 levels.
        """
        if depth > _MAX_DEPTH:
            raise UnsupportedArgumentError(
                f"preprocessing argument {path!r} nests deeper than {_MAX_DEPTH} levels"
            )
        if value is None:
            return self.none()
        if isinstance(value, bool):
            return self.boolean(value)
        if isinstance(value, numbers.Integral):
            return self.integer(int(value))
        if isinstance(value, numbers.Real):
            return self.real(float(value))
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, bytes | bytearray):
            return self.blob(bytes(value))
        if isinstance(value, Mapping):
            keys = list(value.keys())
            bad = [key for key in keys if not isinstance(key, str)]
            if bad:
                raise UnsupportedArgumentError(
                    f"preprocessing argument {path!r} has non-string keys {bad!r}; "
                    "mapping keys must be str"
                )
            self._parts.append(_MAP + _U64.pack(len(keys)))
            for key in sorted(keys):
                self.text(key)
                self.argument(value[key], f"{path}.{key}", depth + 1)
            return self
        if isinstance(value, Sequence):
            self.sequence_header(len(value))
            for index, item in enumerate(value):
                self.argument(item, f"{path}[{index}]", depth + 1)
            return self
        raise UnsupportedArgumentError(
            f"preprocessing argument {path!r} has type {type(value).__name__!r}; allowed: None, "
            "bool, int, float, str, bytes, and sequences or str-keyed mappings of those"
        )

    def encoded(self) -> bytes:
        """The record's bytes."""
        return b"".join(self._parts)

    def digest(self) -> bytes:
        """XXH3-128 of the record with :data:`FIELD_SEED`: :data:`KEY_BYTES` bytes."""
        return digest_record(self.encoded())


def digest_record(record: bytes) -> bytes:
    """XXH3-128 of an encoded record with :data:`FIELD_SEED` (16 bytes)."""
    return bytes(xxhash.xxh3_128_digest(record, seed=FIELD_SEED))


def digest_bytes(data: memoryview) -> bytes:
    """XXH3-128 of a flat byte view with :data:`CONTENT_SEED` (16 bytes), without copying it."""
    return bytes(xxhash.xxh3_128_digest(data, seed=CONTENT_SEED))
