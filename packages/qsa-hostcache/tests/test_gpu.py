"""Pinned arena and side-stream copies between CUDA tensors and the arena (GPU machine only)."""

from __future__ import annotations

import pytest
import torch

from qsa_hostcache import (
    CacheNamespace,
    CopyFence,
    HostPrefixCache,
    PrefixKey,
    SegmentSpec,
    TicketState,
    prompt_segment_spec,
)

pytestmark = pytest.mark.gpu

NS = CacheNamespace("m@1", "float8_e4m3fn", 1, 0, "cfg")
MIB = 1 << 20
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU time: long enough that queued copies are in flight


def busy_gpu() -> None:
    """Keep the current stream busy so work queued after it is still in flight."""
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]


def key(pages: int, first: int = 0) -> PrefixKey:
    return PrefixKey(NS, list(range(first, first + 64 * pages)))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8).cpu()


def test_arena_is_pinned_where_cuda_exists() -> None:
    """With CUDA the default arena is page-locked and the stats say so."""
    cache = HostPrefixCache(8 * MIB)
    assert cache.pinned
    assert cache.stats().pinned_memory
    assert cache._arena.buffer().is_pinned()


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda"), 0, None])
def test_an_arena_for_cuda_without_an_index_takes_the_current_devices_tensors(
    device: object,
) -> None:
    """``device="cuda"`` (how engines name their device) is the current device, ``cuda:0``."""
    cache = HostPrefixCache(4 * MIB, block_bytes=MIB, device=device)  # type: ignore[arg-type]
    segment = torch.arange(1024, device=torch.device("cuda", torch.cuda.current_device()))
    ticket = cache.publish(key(1), {"segment": segment}, wait=True)
    assert ticket is not None
    assert ticket.state is TicketState.PUBLISHED


def test_cuda_segments_round_trip_bit_exactly() -> None:
    """fp8, bf16, int64 and a non-contiguous CUDA slice come back identical, to CUDA and CPU."""
    cache = HostPrefixCache(64 * MIB, block_bytes=MIB)
    g = torch.Generator(device="cuda").manual_seed(0)
    conv = torch.randn(3, 8, 1000, device="cuda", generator=g)
    segs = {
        "raw_kv": torch.randn(12, 2, 64, 256, device="cuda", generator=g).to(torch.float8_e4m3fn),
        "index": torch.randn(12, 16, 128, device="cuda", generator=g).to(torch.bfloat16),
        "rope": torch.arange(4, device="cuda", dtype=torch.int64) * (2**40),
        "conv_slot": conv[:, 5],  # non-contiguous, like a pool's slot column
    }
    ticket = cache.publish(key(3), segs, wait=True)
    assert ticket is not None
    assert ticket.state is TicketState.PUBLISHED
    lease = cache.acquire(key(4))
    assert lease is not None
    with lease:
        on_gpu = {n: torch.empty(t.shape, dtype=t.dtype, device="cuda") for n, t in segs.items()}
        cache.restore(lease, on_gpu).wait()
        on_cpu = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in segs.items()}
        assert cache.restore(lease, on_cpu).done()
    torch.cuda.synchronize()
    for name, src in segs.items():
        assert torch.equal(as_bytes(on_gpu[name]), as_bytes(src)), name
        assert torch.equal(as_bytes(on_cpu[name]), as_bytes(src)), name


def test_a_checkpoint_extending_another_restores_to_the_device_from_both_arenas_blocks() -> None:
    """fp8 K/V rows of a prompt at 2 and 5 pages: the longer copies only its rows from the
    device, and its restore to the device reads the first rows from the shorter's blocks."""
    cache = HostPrefixCache(64 * MIB, block_bytes=MIB)
    g = torch.Generator(device="cuda").manual_seed(1)
    kv = torch.randn(5 * 64, 8, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
    state = torch.randn(3, 1000, device="cuda", generator=g)
    for pages in (2, 5):
        segs = {"k.0": kv[: pages * 64], "state.0": state * pages}
        specs = [prompt_segment_spec(n, t) for n, t in segs.items()]
        ticket = cache.reserve(key(pages), specs)
        assert ticket is not None
        ticket.write(segs)
        ticket.commit()
        assert ticket.wait()
    assert cache.stats().shared_bytes == 2 * 64 * 8 * 128
    lease = cache.acquire(key(5))
    assert lease is not None
    with lease:
        k = torch.empty(5 * 64, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(3, 1000, device="cuda")
        busy_gpu()  # the restore is ordered after it, and the result read after the restore
        cache.restore(lease, {"k.0": k, "state.0": s}).wait()
    assert torch.equal(as_bytes(k), as_bytes(kv))
    assert torch.equal(s, state * 5)


def test_checkpoint_is_invisible_until_device_copies_finish() -> None:
    """While the D2H copies wait behind the producer's work, the checkpoint does not match."""
    cache = HostPrefixCache(64 * MIB, block_bytes=MIB)
    src = torch.full((16 * MIB,), 3, dtype=torch.uint8, device="cuda")
    busy_gpu()  # the producer is still busy on the current stream
    ticket = cache.publish(key(2), {"kv": src})
    assert ticket is not None
    assert ticket.state is TicketState.COMMITTING
    assert cache.match(key(2)) is None
    assert ticket.wait()
    m = cache.match(key(2))
    assert m is not None
    assert m.entry_id == ticket.entry_id
    with cache.pin(m) as lease:  # type: ignore[union-attr]
        out = torch.zeros(16 * MIB, dtype=torch.uint8)
        cache.restore(lease, {"kv": out})
    assert bool(out.eq(3).all())


def test_drain_lands_every_committing_checkpoint_and_empties_the_reserved_gauge() -> None:
    """An idle drain waits for the copies in flight; nothing is left reserved or committing."""
    cache = HostPrefixCache(64 * MIB, block_bytes=MIB)
    busy_gpu()  # both checkpoints' copies wait behind the producer
    tickets = [
        cache.publish(key(n), {"kv": torch.full((8 * MIB,), n, dtype=torch.uint8, device="cuda")})
        for n in (2, 3)
    ]
    assert [t.state for t in tickets if t is not None] == [TicketState.COMMITTING] * 2
    assert cache.drain() == 2
    assert [t.state for t in tickets if t is not None] == [TicketState.PUBLISHED] * 2
    stats = cache.stats()
    assert (stats.reserved_entries, stats.ready_entries) == (0, 2)
    assert cache.drain() == 0


def test_restore_is_ordered_after_pending_writes_to_the_target() -> None:
    """A fill queued on the current stream before restore cannot overwrite the restored bytes."""
    cache = HostPrefixCache(8 * MIB, block_bytes=MIB)
    cache.publish(key(1), {"kv": torch.full((MIB,), 5, dtype=torch.uint8)})
    dst = torch.zeros(MIB, dtype=torch.uint8, device="cuda")
    lease = cache.acquire(key(1))
    assert lease is not None
    busy_gpu()
    dst.fill_(7)
    fence = cache.restore(lease, {"kv": dst})
    fence.wait()
    lease.release()
    assert bool(dst.eq(5).all().item())


def restore_in_flight(cache: HostPrefixCache) -> tuple[torch.Tensor, CopyFence]:
    """Publish 4 MiB of ones as ``key(1, 0)``, then restore it behind a busy GPU and release the
    lease: the read is still queued when this returns, its blocks free for a write to reuse."""
    cache.publish(key(1, 0), {"kv": torch.full((4 * MIB,), 1, dtype=torch.uint8)})
    dst = torch.zeros(4 * MIB, dtype=torch.uint8, device="cuda")
    lease = cache.acquire(key(1, 0))
    assert lease is not None
    busy_gpu()  # the restore's H2D copy is queued behind this
    fence = cache.restore(lease, {"kv": dst})
    lease.release()
    return dst, fence


def test_device_read_completes_before_a_cpu_write_reuses_its_blocks() -> None:
    """An evicted entry's blocks are overwritten by a CPU publish only after its restore read."""
    cache = HostPrefixCache(4 * MIB, block_bytes=4 * MIB)
    dst, fence = restore_in_flight(cache)
    # one block only: this evicts the entry just read and writes the same host bytes
    assert cache.publish(key(1, 9), {"kv": torch.full((4 * MIB,), 2, dtype=torch.uint8)})
    fence.synchronize()
    assert bool(dst.eq(1).all().item())
    assert cache.stats().evictions == 1


def test_device_read_completes_before_a_device_write_reuses_its_blocks() -> None:
    """An evicted entry's blocks are overwritten by a device publish only after its restore read.

    Reads and writes run on streams of their own; the write stream waits for the last read.
    """
    cache = HostPrefixCache(4 * MIB, block_bytes=4 * MIB)
    dst, fence = restore_in_flight(cache)
    producer = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # does not wait for the sleep
    with torch.cuda.stream(producer):
        src = torch.full((4 * MIB,), 2, dtype=torch.uint8, device="cuda")
        ticket = cache.reserve(key(1, 9), [SegmentSpec.like("kv", src)])  # evicts the entry read
        assert ticket is not None
        ticket.write({"kv": src})
        ticket.commit()
    fence.synchronize()
    assert bool(dst.eq(1).all().item())
    assert cache.stats().evictions == 1
    restored = torch.zeros(4 * MIB, dtype=torch.uint8, device="cuda")
    lease = cache.acquire(key(1, 9))
    assert lease is not None
    cache.restore(lease, {"kv": restored}).synchronize()
    lease.release()
    assert bool(restored.eq(2).all().item())


def test_a_restore_does_not_queue_behind_a_publish_in_flight() -> None:
    """A device read completes while a device write issued before it is still held back."""
    cache = HostPrefixCache(8 * MIB, block_bytes=MIB)
    cache.publish(key(1, 0), {"kv": torch.full((MIB,), 3, dtype=torch.uint8)})
    lease = cache.acquire(key(1, 0))
    assert lease is not None
    writer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    reader = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(writer):
        for _ in range(4):  # ~2 s: the write below waits for its producer's stream
            busy_gpu()
        src = torch.ones(MIB, dtype=torch.uint8, device="cuda")
        ticket = cache.reserve(key(1, 5), [SegmentSpec.like("kv", src)])
        assert ticket is not None
        write = ticket.write({"kv": src})
    with torch.cuda.stream(reader):
        dst = torch.zeros(MIB, dtype=torch.uint8, device="cuda")
        read = cache.restore(lease, {"kv": dst})
    read.synchronize()
    assert not write.done()  # the read did not wait for the sleeping write
    assert bool(dst.eq(3).all().item())
    ticket.commit()
    lease.release()
    cache.drain()
    assert cache.stats().entries == 2


def test_abort_with_copies_in_flight_frees_the_space() -> None:
    """Aborting a ticket whose device copies are queued waits for them and frees its blocks."""
    cache = HostPrefixCache(16 * MIB, block_bytes=MIB)
    ticket = cache.reserve(key(1), [SegmentSpec("kv", 8 * MIB)])
    assert ticket is not None
    busy_gpu()
    ticket.write({"kv": torch.ones(8 * MIB, dtype=torch.uint8, device="cuda")})
    ticket.abort()
    assert ticket.state is TicketState.ABORTED
    s = cache.stats()
    assert (s.used_bytes, s.entries, s.aborts) == (0, 0, 1)
