"""The byte mover: one host tensor allocated up front, and copies between it and caller tensors.

This is the checkpoint arena: flat bytes cut into blocks that checkpoints of any segments share.
It is not the offload path's request K/V arena (``qsa_kernels.offload.OffloadedKV.host_arena``,
one fixed row of raw K/V history per request).

The arena knows block ids and byte offsets, never keys. On a machine with CUDA it is pinned and
every copy to or from a CUDA tensor runs on a side stream, ordered after the caller's current
stream and signalled by an event; copies to or from CPU tensors are synchronous. Writes (device to
host) and reads (host to device) have a side stream each, so a restore never queues behind a
publish's copies and both directions of the link carry at once. A device write first waits for the
last device read, so blocks a released lease gave back are not overwritten while still being read;
a CPU write waits for it on the host. A read needs no such order: a checkpoint is matchable only
once its writes have completed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from qsa_hostcache._errors import ArenaAllocationError, DeviceError, SegmentError
from qsa_hostcache._layout import plan_extents

logger = logging.getLogger(__name__)


class CopyFence:
    """Completion of the copies one publish write or one restore enqueued.

    CPU copies complete before the call that made them returns, so their fence is always done.
    """

    __slots__ = ("_device", "_event")

    def __init__(
        self, event: torch.cuda.Event | None = None, device: torch.device | None = None
    ) -> None:
        self._event = event
        self._device = device

    def done(self) -> bool:
        """True when every copy has completed (non-blocking)."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        """Block the calling thread until every copy has completed."""
        if self._event is not None:
            self._event.synchronize()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: the current CUDA stream) after the copies, without blocking.

        After a restore, call this before launching work that reads the restored tensors.
        """
        if self._event is None:
            return
        target = stream if stream is not None else torch.cuda.current_stream(self._device)
        target.wait_event(self._event)


def byte_view(tensor: torch.Tensor, *, writable: bool) -> torch.Tensor:
    """``tensor``'s bytes as a flat ``[nbytes]`` uint8 tensor sharing its storage.

    A source is first materialised (a conjugate or negative view resolved, a non-contiguous one
    copied); a destination must be contiguous and plain (:meth:`HostArena.check` refuses others).
    """
    if not writable:
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
    # A contiguous tensor's elements are dense from its offset, but a size-1 dimension may keep
    # any stride, which ``view(dtype)`` refuses: flatten through explicit unit strides.
    return tensor.as_strided((tensor.numel(),), (1,)).view(torch.uint8)


class HostArena:
    """One flat ``[capacity_bytes]`` uint8 host tensor, pinned where CUDA is available.

    Args:
        capacity_bytes: Size of the arena; allocated once, here.
        pin_memory: ``True`` requires CUDA; ``None`` pins exactly when CUDA is available.
        device: CUDA device whose tensors this arena copies to and from (default: current).
    """

    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: int,
        *,
        pin_memory: bool | None = None,
        device: torch.device | str | int | None = None,
    ) -> None:
        cuda = torch.cuda.is_available()
        pin = cuda if pin_memory is None else pin_memory
        if pin and not cuda:
            raise DeviceError("pin_memory=True needs CUDA, but torch.cuda.is_available() is False")
        self._device: torch.device | None = None
        # One stream per direction: a restore (host to device) never queues behind a publish's
        # copies (device to host), and the two use the link's two directions at once.
        self._write_stream: torch.cuda.Stream | None = None
        self._read_stream: torch.cuda.Stream | None = None
        if cuda:
            dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
            self._device = (
                torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
            )
            if self._device.type != "cuda":
                raise DeviceError(f"device must be a CUDA device, got {self._device!r}")
            index: int | None = self._device.index  # None for "cuda": the current device
            if index is None:
                self._device = torch.device("cuda", torch.cuda.current_device())
            self._write_stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
            self._read_stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
        start = time.perf_counter()
        try:
            self._buf = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=pin)
        except (RuntimeError, TypeError, OverflowError, MemoryError) as exc:  # torch's own words
            what = "pinned" if pin else "pageable"
            msg = (
                f"cannot allocate a {what} host arena of {capacity_bytes!r} bytes "
                f"({capacity_bytes / 2**30:.1f} GiB); lower the budget "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            )
            raise ArenaAllocationError(msg) from None
        self.pinned = bool(pin and self._buf.is_pinned())
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self._last_read: torch.cuda.Event | None = None
        logger.info(
            "host arena: %d bytes, blocks of %d bytes, pinned=%s, device=%s, allocated in %.3f s",
            capacity_bytes,
            block_bytes,
            self.pinned,
            self._device,
            time.perf_counter() - start,
        )

    @property
    def device(self) -> torch.device | None:
        """The CUDA device copies go to and from, or ``None`` without CUDA."""
        return self._device

    def buffer(self) -> torch.Tensor:
        """The arena tensor itself (``[capacity_bytes]`` uint8); for tests and diagnostics."""
        return self._buf

    def check(self, tensor: object, *, target: bool) -> bool:
        """Raise unless this arena can copy ``tensor``'s bytes; True when it is on the CUDA device.

        Every copy entry point calls this for all its tensors before it reserves, evicts or copies
        anything, so a refused tensor leaves the cache as it was.

        Args:
            tensor: A segment's source (``target=False``) or a restore target (``target=True``).
            target: A target must also be contiguous and not a conjugate or negative view (the
                bytes are written through it as they are).

        Raises:
            SegmentError: Not a tensor, nested, quantized, sparse or another non-strided layout,
                or a target that is not plain and contiguous.
            DeviceError: A tensor on a device other than CPU or the arena's CUDA device.
        """
        if not isinstance(tensor, torch.Tensor):
            raise SegmentError(f"a segment must be a torch.Tensor; got {type(tensor).__name__}")
        if tensor.is_nested:
            raise SegmentError(
                "nested tensors have no single byte layout; pass each component as its own segment"
            )
        if tensor.layout is not torch.strided:
            raise SegmentError(
                f"segment tensors must be dense (torch.strided); got layout {tensor.layout!r}"
            )
        if tensor.is_quantized:
            raise SegmentError(
                f"quantized tensors (dtype {tensor.dtype!r}) have no plain byte view; pass "
                "tensor.int_repr() and its quantization parameters as segments"
            )
        on_device = self._check_device(tensor)
        if target and (tensor.is_conj() or tensor.is_neg() or not tensor.is_contiguous()):
            raise SegmentError(
                f"restore targets must be plain contiguous tensors; got shape "
                f"{tuple(tensor.shape)!r}, strides {tensor.stride()!r}, conjugate view "
                f"{tensor.is_conj()!r}, negative view {tensor.is_neg()!r}"
            )
        return on_device

    def _check_device(self, tensor: torch.Tensor) -> bool:
        """True for a CUDA tensor on the arena's device, False for a CPU tensor; else raise."""
        if tensor.device.type == "cpu":
            return False
        if tensor.device.type == "cuda" and tensor.device == self._device:
            return True
        allowed = "'cpu'" if self._device is None else f"'cpu' and {str(self._device)!r}"
        raise DeviceError(
            f"tensor on {str(tensor.device)!r}; this arena copies to and from {allowed} only"
        )

    def write(
        self, blocks: tuple[int, ...], items: Sequence[tuple[int, torch.Tensor]]
    ) -> CopyFence:
        """Copy each ``(stream offset, source tensor)`` into the checkpoint stored in ``blocks``."""
        on_device = [self._check_device(t) for _, t in items]
        if not all(on_device):
            self._sync_reads()
            for (offset, tensor), dev in zip(items, on_device, strict=True):
                if not dev:
                    self._copy_in(blocks, offset, byte_view(tensor, writable=False), False)
        if not any(on_device):
            return CopyFence()
        stream = self._write_stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self._device))
        if self._last_read is not None:  # blocks a finished lease gave back may still be read
            stream.wait_event(self._last_read)
        with torch.cuda.stream(stream):
            for (offset, tensor), dev in zip(items, on_device, strict=True):
                if dev:
                    self._copy_in(blocks, offset, byte_view(tensor, writable=False), True)
                    tensor.record_stream(stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return CopyFence(event, self._device)

    def read(self, items: Sequence[tuple[tuple[int, ...], int, torch.Tensor]]) -> CopyFence:
        """Copy into each ``(blocks, stream offset, target)`` the checkpoint's bytes from there.

        ``blocks`` hold one checkpoint's stream; a restore reads several checkpoints' blocks
        when the one it restores extends others.
        """
        on_device = [self._check_device(t) for _, _, t in items]
        views = [byte_view(t, writable=True) for _, _, t in items]
        for (blocks, offset, _), view, dev in zip(items, views, on_device, strict=True):
            if not dev:
                self._copy_out(blocks, offset, view, False)
        if not any(on_device):
            return CopyFence()
        # A checkpoint is matchable only once its writes completed: a read never waits for one.
        stream = self._read_stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            for (blocks, offset, tensor), view, dev in zip(items, views, on_device, strict=True):
                if dev:
                    self._copy_out(blocks, offset, view, True)
                    tensor.record_stream(stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        self._last_read = event
        return CopyFence(event, self._device)

    def _copy_in(
        self, blocks: tuple[int, ...], offset: int, src: torch.Tensor, asynchronous: bool
    ) -> None:
        buf = self._buf
        for arena_off, seg_off, n in plan_extents(offset, src.numel(), blocks, self.block_bytes):
            buf[arena_off : arena_off + n].copy_(
                src[seg_off : seg_off + n], non_blocking=asynchronous
            )

    def _copy_out(
        self, blocks: tuple[int, ...], offset: int, dst: torch.Tensor, asynchronous: bool
    ) -> None:
        buf = self._buf
        for arena_off, seg_off, n in plan_extents(offset, dst.numel(), blocks, self.block_bytes):
            dst[seg_off : seg_off + n].copy_(
                buf[arena_off : arena_off + n], non_blocking=asynchronous
            )

    def _sync_reads(self) -> None:
        """Wait for the last device read, so a CPU write cannot overtake it."""
        event = self._last_read
        if event is not None:
            event.synchronize()
