"""A shared tier below the host arena: whole objects by key in a store other processes read too.

:class:`ObjectTier` is all a tier does (put, get and ask for whole objects by key); the
checkpoints' format, digests and keys are :mod:`qsa_hostcache._shared`'s. :class:`MooncakeTier`
is one over Mooncake Store (``mooncake.store.MooncakeDistributedStore``, the optional extra
``qsa-hostcache[mooncake]``).

A tier never fails its caller: a store that is down, slow to answer or answering errors gives
misses. The first error of an incident is logged (a warning) and the tier then answers misses
at once for ``retry_after_s`` seconds before it asks the store again; the recovery is logged
too. Every error and every call answered while down is counted (:class:`TierHealth`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any, Final, Protocol, runtime_checkable

from qsa_hostcache._errors import CacheConfigError

__all__ = ("MooncakeTier", "ObjectTier", "StoreAddress", "TierHealth")

logger = logging.getLogger(__name__)

STORE_SCHEMES: Final = ("mooncake",)
"""The schemes :meth:`StoreAddress.parse` accepts."""

_ADDRESS_FORM: Final = "mooncake://HOST:PORT[?segment_mb=N] (PORT: the mooncake_master RPC port)"


@dataclasses.dataclass(frozen=True, slots=True)
class TierHealth:
    """What a tier's store did, since the tier was made (counters; bytes are payload bytes).

    Attributes:
        puts: objects written.
        gets: objects read back whole.
        errors: store calls that failed (an error code, an exception, an empty read).
        unavailable: calls answered with a miss at once because the store was down.
        bytes_written: bytes of the objects written.
        bytes_read: bytes of the objects read.
    """

    puts: int = 0
    gets: int = 0
    errors: int = 0
    unavailable: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


@runtime_checkable
class ObjectTier(Protocol):
    """A store of whole immutable objects by string key, shared by the processes that use it.

    None of its calls raises for the store's sake: a failed or skipped call is a miss (``False``
    or ``None``), counted in :meth:`health`.
    """

    @property
    def name(self) -> str:
        """The tier's label in metrics and logs (e.g. ``"mooncake"``)."""
        ...

    def put(self, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key`` unless the key holds an object already; True if stored."""
        ...

    def get(self, key: str) -> bytes | None:
        """The object under ``key``, or None (absent, or the store failed)."""
        ...

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether an object is stored under it (False where the store failed)."""
        ...

    def health(self) -> TierHealth:
        """The tier's counters so far."""
        ...

    def close(self) -> None:
        """Let go of the store (no call after it)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where a shared tier's store is: ``mooncake://HOST:PORT[?segment_mb=N]``.

    Attributes:
        scheme: the store's kind (``"mooncake"``).
        host: the Mooncake master's host.
        port: its RPC port (``mooncake_master --rpc_port``).
        segment_mb: MiB of this process's memory lent to the store for objects (0: lend none;
            objects then live in the segments of other clients).
    """

    scheme: str
    host: str
    port: int
    segment_mb: int = 1024

    @classmethod
    def parse(cls, text: str) -> StoreAddress:
        """The address ``text`` names.

        Raises:
            CacheConfigError: ``text`` is not of the form above; the message names the value and
                the form.
        """
        try:
            url = urllib.parse.urlsplit(text)
            port = url.port
            query = urllib.parse.parse_qs(url.query, strict_parsing=bool(url.query))
        except ValueError:
            url, port, query = None, None, {}
        unknown = set(query) - {"segment_mb"}
        if (
            url is None
            or url.scheme not in STORE_SCHEMES
            or not url.hostname
            or port is None
            or url.path not in ("", "/")
            or unknown
        ):
            raise CacheConfigError(f"store address {text!r} is not allowed; use {_ADDRESS_FORM}")
        segment = query.get("segment_mb", ["1024"])[-1]
        if not segment.isdigit():
            raise CacheConfigError(
                f"store address {text!r}: segment_mb={segment!r} must be an int >= 0; use "
                f"{_ADDRESS_FORM}"
            )
        return cls(url.scheme, url.hostname, port, int(segment))

    def local_hostname(self) -> str:
        """This host's address as the store's other clients reach it.

        The address it reaches the master from (``127.0.0.1`` when the master is on a loopback
        address, or when no route is found).
        """
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((self.host, self.port))  # UDP: picks a route, sends nothing
                return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"

    @property
    def master(self) -> str:
        """``HOST:PORT`` of the master."""
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.master}?segment_mb={self.segment_mb}"


#: The head of an object stored in parts: a tag, the number of parts and the object's bytes.
_HEAD: Final = struct.Struct("<8sIQ")
_HEAD_TAG: Final = b"QSAPARTS"


def part_name(key: str, index: int) -> str:
    """The store key of part ``index`` (1 or more) of the object under ``key``.

    Part 0 is the head, stored under ``key`` itself.
    """
    return f"{key}#part{index}"


class MooncakeTier:
    """An :class:`ObjectTier` over Mooncake Store, through its TCP transport.

    A store client moves at most its transfer buffer (``local_buffer_mb``) in one call: an object
    is stored as parts of at most ``part_mb`` MiB (a checkpoint of a 16K-token prompt is hundreds
    of MiB). The parts go first, under :func:`part_name` keys; the head, under the object's own
    key, goes last and holds the part count, the object's length and its first part, so an
    object whose head is visible was written whole. A read whose part is missing (the store
    evicts objects one key at a time) is a counted error and a miss. Each call holds the GIL
    while it runs, so a part's size also bounds how long a put or get keeps the calling
    process's other threads (a scheduler's) waiting.

    The client joins the store on a thread of its own, once the master's port accepts a
    connection (Mooncake's ``setup`` would otherwise retry for about a minute and a half,
    holding the GIL); until it has joined, every call is a miss counted as ``unavailable``.
    A store call is made on the caller's thread and holds the GIL while it runs: a master that
    dies makes the first failing call of each retry period block (about 4 s measured). Set
    ``MC_FORCE_TCP=true`` where the host has RDMA devices the store must not use (it is set
    here unless already set).

    Args:
        address: the master's address (:meth:`StoreAddress.parse`).
        local_hostname: this client's address as the store's other clients reach it (default
            :meth:`StoreAddress.local_hostname`).
        retry_after_s: seconds a failed store call keeps the tier answering misses at once.
        local_buffer_mb: MiB of the client's transfer buffer (at least two parts: one thread
            puts while another gets).
        part_mb: MiB of an object's part.

    Raises:
        ImportError: Mooncake is not installed (``pip install 'qsa-hostcache[mooncake]'``).
        CacheConfigError: ``part_mb`` is not positive or two parts do not fit the buffer.
    """

    def __init__(
        self,
        address: StoreAddress,
        *,
        local_hostname: str | None = None,
        retry_after_s: float = 10.0,
        local_buffer_mb: int = 64,
        part_mb: int = 8,
    ) -> None:
        if not 0 < part_mb <= local_buffer_mb // 2:
            msg = (
                f"part_mb {part_mb!r} with local_buffer_mb {local_buffer_mb!r} is not allowed; "
                "allowed: 1 to local_buffer_mb // 2"
            )
            raise CacheConfigError(msg)
        os.environ.setdefault("MC_FORCE_TCP", "true")
        self._part_bytes = part_mb << 20
        from mooncake.store import MooncakeDistributedStore

        self.address = address
        self._store: Any = MooncakeDistributedStore()
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._health = TierHealth()
        self._down_until = 0.0
        self._incident = False
        self._connected = threading.Event()
        self._closed = threading.Event()
        self._setup_args = (
            local_hostname or address.local_hostname(),
            "P2PHANDSHAKE",
            address.segment_mb << 20,
            local_buffer_mb << 20,
            "tcp",
            "",
            address.master,
        )
        threading.Thread(target=self._connect, name="qsa-mooncake-setup", daemon=True).start()

    @property
    def name(self) -> str:
        return "mooncake"

    @property
    def connected(self) -> bool:
        """True once the client joined the store."""
        return self._connected.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds for the client to join; True if it did."""
        return self._connected.wait(timeout_s)

    def put(self, key: str, value: bytes) -> bool:
        if not self._ready():
            return False
        size = self._part_bytes
        count = max(1, -(-len(value) // size))
        view = memoryview(value)
        try:
            present = self._store.is_exist(key)
            if present == 1:
                return False
            rc = -1 if present < 0 else 0
            for index in range(1, count):  # the head last: once visible, the object is whole
                part = bytes(view[index * size : (index + 1) * size])  # one part copied at a time
                rc = rc or self._store.put(part_name(key, index), part)
            head = _HEAD.pack(_HEAD_TAG, count, len(value)) + view[:size]
            rc = rc or self._store.put(key, head)
        except Exception as exc:
            return self._failed(f"put {key!r}: {exc!r}")
        if rc != 0:
            return self._failed(f"put {key!r} ({count} parts) returned {rc!r}")
        self._count(puts=1, bytes_written=len(value))
        return True

    def get(self, key: str) -> bytes | None:
        if not self._ready():
            return None
        try:
            present = self._store.is_exist(key)
            if present == 0:
                return None
            head = self._store.get(key) if present == 1 else b""
        except Exception as exc:
            self._failed(f"get {key!r}: {exc!r}")
            return None
        if (
            len(head) < _HEAD.size
        ):  # the store answers a failed read (or a vanished object) with b""
            self._failed(f"get {key!r}: exists={present!r} but {len(head)!r} bytes came back")
            return None
        tag, count, length = _HEAD.unpack_from(head)
        if tag != _HEAD_TAG or count < 1:
            self._count(errors=1)
            logger.warning("shared tier: %r is not an object of this tier; not used", key)
            return None
        # bytes only: ``bytes.join`` lets other threads run while it copies only bytes objects
        chunks = [bytes(head[_HEAD.size :])]
        for index in range(1, count):
            try:
                part = self._store.get(part_name(key, index))
            except Exception as exc:
                self._failed(f"get {part_name(key, index)!r}: {exc!r}")
                return None
            if not part:  # evicted apart from its head: a miss, the store itself is fine
                self._count(errors=1)
                logger.debug("shared tier: part %d of %d of %r is gone", index, count, key)
                return None
            chunks.append(bytes(part))  # the store's own bytes: no copy
        value = b"".join(chunks)
        if len(value) != length:
            self._count(errors=1)
            logger.warning(
                "shared tier: %r read back %d bytes of %d; not used", key, len(value), length
            )
            return None
        self._count(gets=1, bytes_read=len(value))
        return value

    def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys or not self._ready():
            return [False] * len(keys)
        try:
            found = self._store.batch_is_exist(list(keys))
        except Exception as exc:
            self._failed(f"batch_is_exist of {len(keys)} keys: {exc!r}")
            return [False] * len(keys)
        if any(f < 0 for f in found):
            self._failed(f"batch_is_exist of {len(keys)} keys returned {sorted(set(found))!r}")
        return [f == 1 for f in found]

    def health(self) -> TierHealth:
        with self._lock:
            return self._health

    def close(self) -> None:
        self._closed.set()
        if self._connected.is_set():
            self._store.close()

    # ---- internals ---------------------------------------------------------------------------

    def _connect(self) -> None:
        """Join the store once its master answers; until then, look again every retry period.

        Mooncake's ``setup`` holds the GIL while it retries a master that does not answer
        (about 90 s): it is called only after the master's port accepted a connection.
        """
        warned = False
        while not self._closed.is_set():
            if self._master_answers():
                try:
                    rc = self._store.setup(*self._setup_args)
                except Exception as exc:  # logged; the tier stays a miss
                    rc = repr(exc)
                if rc == 0:
                    if self._closed.is_set():
                        self._store.close()
                        return
                    self._connected.set()
                    logger.info("shared tier: joined Mooncake Store at %s", self.address)
                    return
                self._count(errors=1)
                logger.warning(
                    "shared tier: cannot join Mooncake Store at %s (setup returned %r); lookups "
                    "miss the shared tier",
                    self.address,
                    rc,
                )
                return
            if not warned:
                warned = True
                logger.warning(
                    "shared tier: the Mooncake master at %s does not answer; lookups miss the "
                    "shared tier until it does (asked again every %.1f s)",
                    self.address,
                    self._retry_after_s,
                )
            self._closed.wait(self._retry_after_s)

    def _master_answers(self) -> bool:
        try:
            socket.create_connection((self.address.host, self.address.port), timeout=2).close()
        except OSError:
            return False
        return True

    def _ready(self) -> bool:
        if not self._connected.is_set() or self._closed.is_set():
            self._count(unavailable=1)
            return False
        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                self._health = dataclasses.replace(
                    self._health, unavailable=self._health.unavailable + 1
                )
                return False
        return True

    def _failed(self, what: str) -> bool:
        with self._lock:
            self._health = dataclasses.replace(self._health, errors=self._health.errors + 1)
            self._down_until = time.monotonic() + self._retry_after_s
            first = not self._incident
            self._incident = True
        if first:
            logger.warning(
                "shared tier %s failed (%s); it answers misses for %.1f s at a time until it "
                "recovers",
                self.address,
                what,
                self._retry_after_s,
            )
        return False

    def _count(self, **more: int) -> None:
        with self._lock:
            h = self._health
            self._health = dataclasses.replace(
                h, **{name: getattr(h, name) + n for name, n in more.items()}
            )
            if more.get("gets") or more.get("puts"):
                if self._incident:
                    logger.info("shared tier %s answers again", self.address)
                self._incident = False
