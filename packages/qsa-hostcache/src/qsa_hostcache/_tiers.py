"""A shared tier below the host arena: whole objects by key in a store other processes read too.

:class:`ObjectTier` is all a tier does (put, get and ask for whole objects by key); the
checkpoints' format, digests and keys are :mod:`qsa_hostcache._shared`'s. Two tiers:
:class:`MooncakeTier` over Mooncake Store (``mooncake.store.MooncakeDistributedStore``, the
optional extra ``qsa-hostcache[mooncake]``), shared by the hosts that join it, and
:class:`DiskTier` over a local directory, shared by the processes of one host and kept across
their restarts. :func:`parse_store_address` reads an operator's address of either;
:func:`open_tier` opens the tier it names.

A tier never fails its caller: a store that is down, slow to answer or answering errors gives
misses. The first error of an incident is logged (a warning) and the tier then answers misses
at once for ``retry_after_s`` seconds before it asks the store again; the recovery is logged
too. Every error and every call answered while down is counted (:class:`TierHealth`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pathlib
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any, Final, Protocol, runtime_checkable

import torch

from qsa_hostcache._errors import CacheConfigError

__all__ = (
    "DiskAddress",
    "DiskTier",
    "MooncakeAddress",
    "MooncakeTier",
    "ObjectTier",
    "StoreAddress",
    "TierHealth",
    "open_tier",
    "parse_store_address",
)

logger = logging.getLogger(__name__)

_MOONCAKE_FORM: Final = "mooncake://HOST:PORT[?segment_mb=N] (PORT: the mooncake_master RPC port)"
_DISK_FORM: Final = "file:///ABSOLUTE/DIR[?max_mb=N] (N: the directory's byte budget in MiB)"
_ADDRESS_FORMS: Final = f"{_MOONCAKE_FORM} or {_DISK_FORM}"
#: The disk tier's byte budget when the address names none.
DEFAULT_DISK_MB: Final = 64 << 10


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

    def put(self, key: str, value: bytes | memoryview) -> bool:
        """Store ``value`` under ``key`` unless the key holds an object already; True if stored."""
        ...

    def get(self, key: str) -> memoryview | None:
        """The object under ``key``, or None (absent, or the store failed).

        A writable buffer of bytes that the caller owns: a checkpoint read from it keeps its
        segments as views of it rather than copies (:func:`qsa_hostcache._shared.decode`).
        """
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
class MooncakeAddress:
    """Where a Mooncake Store is: ``mooncake://HOST:PORT[?segment_mb=N]``.

    Attributes:
        host: the Mooncake master's host.
        port: its RPC port (``mooncake_master --rpc_port``).
        segment_mb: MiB of this process's memory lent to the store for objects (0: lend none;
            objects then live in the segments of other clients).
    """

    host: str
    port: int
    segment_mb: int = 1024

    @property
    def scheme(self) -> str:
        return "mooncake"

    @classmethod
    def parse(cls, text: str) -> MooncakeAddress:
        """The address ``text`` names.

        Raises:
            CacheConfigError: ``text`` is not of the form above; the message names the value and
                the form.
        """
        url, query = _split(text, "mooncake", {"segment_mb"}, _MOONCAKE_FORM)
        if not url.hostname or url.port is None or url.path not in ("", "/"):
            raise CacheConfigError(f"store address {text!r} is not allowed; use {_MOONCAKE_FORM}")
        return cls(url.hostname, url.port, _size(text, query, "segment_mb", 1024, 0))

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
        return f"mooncake://{self.master}?segment_mb={self.segment_mb}"


@dataclasses.dataclass(frozen=True, slots=True)
class DiskAddress:
    """Where a disk tier is: ``file:///ABSOLUTE/DIR[?max_mb=N]``.

    Attributes:
        path: the directory (absolute; made if absent).
        max_mb: MiB the tier's objects may take in it (:data:`DEFAULT_DISK_MB` if not named).
    """

    path: pathlib.Path
    max_mb: int = DEFAULT_DISK_MB

    @property
    def scheme(self) -> str:
        return "file"

    @classmethod
    def parse(cls, text: str) -> DiskAddress:
        """The address ``text`` names.

        Raises:
            CacheConfigError: ``text`` is not of the form above (a host, or a relative path);
                the message names the value and the form.
        """
        url, query = _split(text, "file", {"max_mb"}, _DISK_FORM)
        if url.netloc or not url.path.startswith("/"):
            raise CacheConfigError(f"store address {text!r} is not allowed; use {_DISK_FORM}")
        path = pathlib.Path(urllib.parse.unquote(url.path))
        return cls(path, _size(text, query, "max_mb", DEFAULT_DISK_MB, 1))

    def __str__(self) -> str:
        return f"file://{self.path}?max_mb={self.max_mb}"

    def check_usable(self) -> None:
        """Make the directory if absent and write a file in it, as the tier will.

        Raises:
            CacheConfigError: it cannot be made or written; the message names it and the error.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{os.getpid()}-{threading.get_ident()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            msg = f"disk tier directory {str(self.path)!r} is not usable: {exc}"
            raise CacheConfigError(msg) from exc


#: Any shared tier's address.
StoreAddress = MooncakeAddress | DiskAddress


def parse_store_address(text: str) -> StoreAddress:
    """The address ``text`` names, of either tier.

    ``mooncake://HOST:PORT[?segment_mb=N]`` (:meth:`MooncakeAddress.parse`) or
    ``file:///ABSOLUTE/DIR[?max_mb=N]`` (:meth:`DiskAddress.parse`).

    Raises:
        CacheConfigError: ``text`` is neither; the message names the value and the forms.
    """
    scheme = text.partition("://")[0]
    if scheme == "mooncake":
        return MooncakeAddress.parse(text)
    if scheme == "file":
        return DiskAddress.parse(text)
    raise CacheConfigError(f"store address {text!r} is not allowed; use {_ADDRESS_FORMS}")


def _split(text: str, scheme: str, names: set[str], form: str) -> tuple[Any, dict[str, list[str]]]:
    """``text`` split as a URL of ``scheme`` whose query names only ``names``.

    Raises:
        CacheConfigError: it is not; the message names the value and ``form``.
    """
    try:
        url = urllib.parse.urlsplit(text)
        url.port  # noqa: B018 (raises for a port that is not a number)
        query = urllib.parse.parse_qs(url.query, strict_parsing=bool(url.query))
    except ValueError:
        url, query = None, {}
    if url is None or url.scheme != scheme or set(query) - names:
        raise CacheConfigError(f"store address {text!r} is not allowed; use {form}")
    return url, query


def _size(text: str, query: dict[str, list[str]], name: str, default: int, least: int) -> int:
    """The int ``name`` of an address's query (``default`` if absent), at least ``least``.

    Raises:
        CacheConfigError: it is not such an int; the message names the value and the forms.
    """
    value = query.get(name, [str(default)])[-1]
    if not value.isdigit() or int(value) < least:
        raise CacheConfigError(
            f"store address {text!r}: {name}={value!r} must be an int >= {least}; use "
            f"{_ADDRESS_FORMS}"
        )
    return int(value)


def open_tier(address: StoreAddress) -> ObjectTier:
    """The tier ``address`` names, with its defaults.

    Raises:
        ImportError: a Mooncake address where Mooncake is not installed.
    """
    if isinstance(address, DiskAddress):
        return DiskTier(address)
    return MooncakeTier(address)


class _Health:
    """A tier's counters and incidents, thread-safe.

    The first failure of an incident is logged (a warning), the tier then answers misses at once
    for ``retry_after_s`` seconds, and its recovery is logged too.
    """

    def __init__(self, where: object, retry_after_s: float) -> None:
        self._where = where
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._health = TierHealth()
        self._down_until = 0.0
        self._incident = False

    def snapshot(self) -> TierHealth:
        with self._lock:
            return self._health

    def up(self) -> bool:
        """False (counted ``unavailable``) while an incident's retry period runs."""
        with self._lock:
            if time.monotonic() < self._down_until:
                self._add(unavailable=1)
                return False
        return True

    def failed(self, what: str) -> bool:
        """Count a failed call and start a retry period; False (the call's miss)."""
        with self._lock:
            self._add(errors=1)
            self._down_until = time.monotonic() + self._retry_after_s
            first = not self._incident
            self._incident = True
        if first:
            logger.warning(
                "shared tier %s failed (%s); it answers misses for %.1f s at a time until it "
                "recovers",
                self._where,
                what,
                self._retry_after_s,
            )
        return False

    def count(self, **more: int) -> None:
        with self._lock:
            self._add(**more)
            if (more.get("gets") or more.get("puts")) and self._incident:
                logger.info("shared tier %s answers again", self._where)
                self._incident = False

    def _add(self, **more: int) -> None:
        h = self._health
        self._health = dataclasses.replace(
            h, **{name: getattr(h, name) + n for name, n in more.items()}
        )


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
    A store call is made on the caller's thread and holds the GIL while it runs, and a call to a
    master that died blocks (about 4 s measured). So, once joined, the same thread asks the
    master's port every ``watch_s`` seconds (a TCP connect, which lets other threads run): while
    it does not answer, every call is a miss at once, counted as ``unavailable``, and only a call
    made in the ``watch_s`` after the master died can block. Set
    ``MC_FORCE_TCP=true`` where the host has RDMA devices the store must not use (it is set
    here unless already set).

    Args:
        address: the master's address (:func:`parse_store_address`).
        local_hostname: this client's address as the store's other clients reach it (default
            :meth:`MooncakeAddress.local_hostname`).
        retry_after_s: seconds a failed store call keeps the tier answering misses at once.
        watch_s: seconds between two looks at the master's port once joined.
        local_buffer_mb: MiB of the client's transfer buffer (at least two parts: one thread
            puts while another gets).
        part_mb: MiB of an object's part.

    Raises:
        ImportError: Mooncake is not installed (``pip install 'qsa-hostcache[mooncake]'``).
        CacheConfigError: ``part_mb`` is not positive or two parts do not fit the buffer.
    """

    def __init__(
        self,
        address: MooncakeAddress,
        *,
        local_hostname: str | None = None,
        retry_after_s: float = 10.0,
        watch_s: float = 1.0,
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
        self._watch_s = watch_s
        self._health = _Health(address, retry_after_s)
        self._connected = threading.Event()
        self._answering = threading.Event()
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

    @property
    def master_answers(self) -> bool:
        """True once joined while the master's port answered at the last look."""
        return self._answering.is_set()

    def put(self, key: str, value: bytes | memoryview) -> bool:
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

    def get(self, key: str) -> memoryview | None:
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
        # one part copied into place at a time, so no copy holds the GIL for long
        value, filled, end = uninitialised(length), 0, 0
        for index in range(count):
            try:
                part = (
                    memoryview(head)[_HEAD.size :]  # the head's own bytes: no copy
                    if index == 0
                    else self._store.get(part_name(key, index))
                )
            except Exception as exc:
                self._failed(f"get {part_name(key, index)!r}: {exc!r}")
                return None
            if index and not part:  # evicted apart from its head: a miss, the store is fine
                self._count(errors=1)
                logger.debug("shared tier: part %d of %d of %r is gone", index, count, key)
                return None
            end = filled + len(part)
            if end > length:
                break
            value[filled:end] = part
            filled = end
        if end != length:
            self._count(errors=1)
            logger.warning(
                "shared tier: %r read back other than its %d bytes; not used", key, length
            )
            return None
        self._count(gets=1, bytes_read=length)
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
        return self._health.snapshot()

    def close(self) -> None:
        self._closed.set()
        if self._connected.is_set():
            self._store.close()

    # ---- internals ---------------------------------------------------------------------------

    def _connect(self) -> None:
        """Join the store once its master answers, then watch its port (:meth:`_watch`).

        Until the master answers, it is asked again every retry period. Mooncake's ``setup``
        holds the GIL while it retries a master that does not answer (about 90 s): it is called
        only after the master's port accepted a connection.
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
                    self._answering.set()
                    self._connected.set()
                    logger.info("shared tier: joined Mooncake Store at %s", self.address)
                    self._watch()
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

    def _watch(self) -> None:
        """Look at the master's port every ``watch_s`` until closed; log each change."""
        while not self._closed.wait(self._watch_s):
            answers = self._master_answers()
            if answers == self._answering.is_set():
                continue
            if answers:
                self._answering.set()
                logger.info("shared tier: the Mooncake master at %s answers again", self.address)
            else:
                self._answering.clear()
                logger.warning(
                    "shared tier: the Mooncake master at %s stopped answering; lookups miss the "
                    "shared tier until it answers again",
                    self.address,
                )

    def _master_answers(self) -> bool:
        try:
            socket.create_connection((self.address.host, self.address.port), timeout=2).close()
        except OSError:
            return False
        return True

    def _ready(self) -> bool:
        if not self._answering.is_set() or self._closed.is_set():
            self._count(unavailable=1)
            return False
        return self._health.up()

    def _failed(self, what: str) -> bool:
        return self._health.failed(what)

    def _count(self, **more: int) -> None:
        self._health.count(**more)


class DiskTier:
    """An :class:`ObjectTier` over a local directory: one file per object, kept across restarts.

    The processes of one host (replicas, or one replica restarted) share what any of them wrote.
    An object's file is named by the SHA-256 of its key (two levels of directories); it is
    written to a temporary file in the same directory and linked into place, so a reader sees a
    whole file or none, and a key that holds a file is never written again. A read marks its
    file used (its modification time); when the files would take more than ``max_mb`` MiB the
    least recently used go until they take at most 90% of it. Reading a file another process
    is deleting is safe (POSIX keeps an open file's bytes). A file damaged on disk is the
    checkpoint format's to detect (its digest), as in any tier.

    Args:
        address: the directory and its byte budget (:func:`parse_store_address`).
        retry_after_s: seconds a failed file call (a full or read-only disk) keeps the tier
            answering misses at once.

    Raises:
        CacheConfigError: the directory cannot be made or written
            (:meth:`DiskAddress.check_usable`).
    """

    _SUFFIX: Final = ".qsa"

    def __init__(self, address: DiskAddress, *, retry_after_s: float = 10.0) -> None:
        self.address = address
        self._root = address.path
        self._budget = address.max_mb << 20
        self._health = _Health(address, retry_after_s)
        self._lock = threading.Lock()
        address.check_usable()
        self._bytes = sum(size for _, _, size in self._files())

    @property
    def name(self) -> str:
        return "disk"

    def put(self, key: str, value: bytes | memoryview) -> bool:
        if not self._health.up():
            return False
        path = self._path(key)
        if path.exists():
            return False
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_bytes(value)
            try:
                os.link(temporary, path)  # never replaces: another writer's object stays
            except FileExistsError:
                return False
            finally:
                temporary.unlink(missing_ok=True)
        except OSError as exc:
            return self._health.failed(f"write {str(path)!r}: {exc}")
        self._health.count(puts=1, bytes_written=len(value))
        with self._lock:
            self._bytes += len(value)
            over = self._bytes > self._budget
        if over:
            self._evict()
        return True

    def get(self, key: str) -> memoryview | None:
        if not self._health.up():
            return None
        path = self._path(key)
        try:
            value = _read_whole(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._health.failed(f"read {str(path)!r}: {exc}")
            return None
        with contextlib.suppress(OSError):  # evicted since the read: the value is whole still
            os.utime(path)  # used now: the last to go
        self._health.count(gets=1, bytes_read=len(value))
        return value

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return [self._path(key).is_file() for key in keys]

    def health(self) -> TierHealth:
        return self._health.snapshot()

    def close(self) -> None:
        """Nothing to let go: the files stay for the next process."""

    def _path(self, key: str) -> pathlib.Path:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return self._root / digest[:2] / f"{digest}{self._SUFFIX}"

    def _files(self) -> list[tuple[float, pathlib.Path, int]]:
        """``(last used, path, bytes)`` of every object file, as the directory holds them now."""
        found = []
        for path in self._root.glob(f"*/*{self._SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another process evicted it
                continue
            found.append((stat.st_mtime, path, stat.st_size))
        return found

    def _evict(self) -> None:
        """Remove the least recently used files until they take at most 90% of the budget.

        The directory is listed again: other processes write and evict in it too.
        """
        with self._lock:
            files = sorted(self._files(), key=lambda f: f[0])
            total = sum(size for _, _, size in files)
            target = self._budget * 9 // 10
            for _, path, size in files:
                if total <= target:
                    break
                path.unlink(missing_ok=True)
                total -= size
            self._bytes = total


def uninitialised(size: int) -> memoryview:
    """A new writable buffer of ``size`` bytes, not zeroed first (each byte is written once)."""
    return torch.empty(size, dtype=torch.uint8).numpy().data  # the view keeps the tensor


def _read_whole(path: pathlib.Path) -> memoryview:
    """The file's bytes read straight into one new buffer (no intermediate ``bytes`` copy).

    The reads release the GIL; each is at most what one ``read`` call moves (about 2 GiB on
    Linux), so an object of any size is read in a few calls.

    Raises:
        OSError: the file cannot be read, or it changed length while it was read.
    """
    with path.open("rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        value = uninitialised(size)
        filled = 0
        while filled < size:
            got = file.readinto(value[filled:])
            if not got:
                break
            filled += got
    if filled != size:
        raise OSError(f"{str(path)!r} held {filled!r} of its {size!r} bytes when read")
    return value
