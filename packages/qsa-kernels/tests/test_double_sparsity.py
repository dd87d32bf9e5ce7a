"""Double-sparsity label cache, per-KV-head sparse decode, resident decode and DS-Offload."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from qsa_kernels import KernelInputError, KernelPath
from qsa_kernels.double_sparsity import (
    DSConfig,
    DSConfigError,
    DSOffloadedKV,
    LabelCache,
    ds_decode,
    ds_decode_reference,
    ds_decode_split,
    ds_decode_split_reference,
    ds_heavy_decode_split,
    ds_heavy_decode_split_reference,
    ds_positions,
    ds_positions_fixed,
)
from qsa_kernels.ds_label import label_keys_reference
from qsa_kernels.offload import OffloadGeometry
from qsa_kernels.sparse_decode import (
    sparse_decode,
    sparse_decode_reference,
    sparse_decode_split_reference,
)


def _quarters(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 values in {-0.5, -0.25, 0, 0.25, 0.5}: label scores are exact in fp32, so the
    selection of every implementation is the same (ties to the smaller position)."""
    return (torch.randint(-2, 3, shape, generator=gen).float() / 4).to(torch.bfloat16)


def _channels(gen: torch.Generator, layers: int, hkv: int, d: int, c: int) -> torch.Tensor:
    return torch.stack(
        [
            torch.stack([torch.randperm(d, generator=gen)[:c] for _ in range(hkv)])
            for _ in range(layers)
        ]
    ).to(torch.int32)


def _expected(  # noqa: PLR0917
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    channels: torch.Tensor,
    config: DSConfig,
    scale: float,
) -> tuple[torch.Tensor, list[list[list[int]]]]:
    """Plain double sparsity, written from the definition: per (row, KV head) label scores in
    fp64, top tokens by (score desc, position asc), then fp32 attention over those tokens."""
    batch, hq, d = q.shape
    hkv = channels.shape[0]
    group = hq // hkv
    out = torch.zeros(batch, hq, d)
    chosen: list[list[list[int]]] = []
    for b in range(batch):
        n = ks[b].shape[0]
        per_head = []
        for g in range(hkv):
            heads = range(g * group, (g + 1) * group)
            if config.is_dense(n):
                sel = list(range(n))
            else:
                ch = channels[g].long()
                qk = q[b, list(heads)][:, ch].double() @ ks[b][:, g, ch].double().T  # [G, n]
                score = qk.sum(0).tolist()
                sel = sorted(
                    sorted(range(n), key=lambda t: (-score[t], t))[: config.heavy_token_num]
                )
            per_head.append(sel)
            k = ks[b][sel, g].float()
            v = vs[b][sel, g].float()
            for h in heads:
                p = torch.softmax(q[b, h].float() @ k.T * scale, dim=0)
                out[b, h] = p @ v
        chosen.append(per_head)
    return out, chosen


def _positions_as_lists(positions: torch.Tensor) -> list[list[list[int]]]:
    return [[[int(x) for x in head if x >= 0] for head in row] for row in positions.cpu().tolist()]


class _Resident:
    """A resident K/V store of one layer and its label cache, rows laid out one after another."""

    def __init__(
        self,
        ks: Sequence[torch.Tensor],
        vs: Sequence[torch.Tensor],
        channels: torch.Tensor,
        *,
        max_tokens: int,
        device: str,
        kv_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        rows = len(ks)
        self.device = device
        hkv, d = ks[0].shape[1:]
        self.labels = LabelCache(
            channels.unsqueeze(0), rows=rows, max_tokens=max_tokens, device=device
        )
        records = torch.zeros(rows, max_tokens, 2, hkv, d, dtype=kv_dtype)
        for r, (k, v) in enumerate(zip(ks, vs, strict=True)):
            records[r, : k.shape[0], 0] = k.to(kv_dtype)
            records[r, : k.shape[0], 1] = v.to(kv_dtype)
            self.labels.write_prompt(0, r, k.to(kv_dtype).to(device))
        # [R, M, 2, Hkv, D] -> records [R * M / 4, 2, 4, Hkv, D]
        self.kv = (
            records.view(rows, max_tokens // 4, 4, 2, hkv, d)
            .permute(0, 1, 3, 2, 4, 5)
            .reshape(rows * max_tokens // 4, 2, 4, hkv, d)
            .contiguous()
            .to(device)
        )
        self.lengths = [int(k.shape[0]) for k in ks]
        self.req_to_token = self.labels.slots(range(rows), max(self.lengths))

    def decode(self, q: torch.Tensor, config: DSConfig, *, reference: bool = False) -> Any:
        fn = ds_decode_reference if reference else ds_decode
        return fn(
            q.to(self.device),
            self.kv,
            self.labels.layer(0),
            self.labels.channels[0],
            self.req_to_token,
            self.lengths,
            config=config,
        )


def _case(  # noqa: PLR0917
    lengths: Sequence[int], hq: int, hkv: int, d: int, c: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = _quarters(gen, len(lengths), hq, d)
    ks = [_quarters(gen, n, hkv, d) for n in lengths]
    vs = [torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16) for n in lengths]
    return q, ks, vs, _channels(gen, 1, hkv, d, c)[0]


# -- label cache ---------------------------------------------------------------------------------


def test_label_cache_rows_equal_label_keys_reference() -> None:
    """Prompt writes and decode appends store exactly label_keys_reference of each key."""
    gen = torch.Generator().manual_seed(1)
    channels = _channels(gen, 2, 3, 16, 5)
    cache = LabelCache(channels, rows=3, max_tokens=24)
    prompts = {0: _quarters(gen, 2, 7, 3, 16), 2: _quarters(gen, 2, 13, 3, 16)}
    for row, k in prompts.items():
        for layer in range(2):
            cache.write_prompt(layer, row, k[layer])
    new = _quarters(gen, 2, 2, 3, 16)
    for layer in range(2):
        cache.append(layer, [2, 0], [13, 7], new[layer])
    for layer in range(2):
        full0 = torch.cat([prompts[0][layer], new[layer, 1:2]])
        full2 = torch.cat([prompts[2][layer], new[layer, 0:1]])
        want0 = label_keys_reference(full0, channels[layer])
        want2 = label_keys_reference(full2, channels[layer])
        assert torch.equal(cache.layer(layer)[0:8], want0)
        assert torch.equal(cache.layer(layer)[48:62], want2)
        assert not cache.layer(layer)[24:48].any()  # row 1 never written


def test_label_cache_upcasts_fp8_keys() -> None:
    """FP8 keys are stored as their unscaled bf16 value."""
    gen = torch.Generator().manual_seed(2)
    channels = _channels(gen, 1, 2, 16, 4)
    cache = LabelCache(channels, rows=1, max_tokens=8)
    k = torch.randn(5, 2, 16, generator=gen).to(torch.float8_e4m3fn)
    cache.write_prompt(0, 0, k)
    assert torch.equal(cache.layer(0)[:5], label_keys_reference(k.to(torch.bfloat16), channels[0]))


@pytest.mark.parametrize(
    ("kv_dtype", "label"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float8_e4m3fn, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_label_dtype_keeps_16_bit_keys_and_upcasts_the_rest_to_bf16(
    kv_dtype: torch.dtype, label: torch.dtype
) -> None:
    assert LabelCache.dtype_for(kv_dtype) is label
    LabelCache(torch.zeros(1, 1, 2, dtype=torch.int32), rows=1, max_tokens=4, dtype=label)


def test_label_cache_slot_table_addresses_rows_back_to_back() -> None:
    """slots(rows, w)[b, t] = rows[b] * max_tokens + t."""
    cache = LabelCache(torch.zeros(1, 1, 2, dtype=torch.int32), rows=4, max_tokens=12)
    assert cache.slots([3, 1], 3).tolist() == [[36, 37, 38], [12, 13, 14]]


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda c: c.write_prompt(0, 0, torch.zeros(9, 2, 16), start=0), r"\[0, 9\) of row 0"),
        (lambda c: c.write_prompt(0, 2, torch.zeros(1, 2, 16)), r"row=2 .*\[0, 2\)"),
        (lambda c: c.append(0, [1], [8], torch.zeros(1, 2, 16)), r"position 8 of row 1"),
        (lambda c: c.append(1, [1], [0], torch.zeros(1, 2, 16)), r"layer=1 .*\[0, 1\)"),
        (lambda c: c.append(0, [0, 1], [0], torch.zeros(2, 2, 16)), "must agree on B"),
        (lambda c: c.write_prompt(0, 0, torch.zeros(2, 3, 16)), r"Hkv=2"),
    ],
)
def test_label_cache_rejects_out_of_range_writes(
    call: Callable[[LabelCache], None], pattern: str
) -> None:
    """Writes outside the row, the layer or the preallocated positions raise DSConfigError."""
    cache = LabelCache(torch.zeros(1, 2, 4, dtype=torch.int32), rows=2, max_tokens=8)
    with pytest.raises(DSConfigError, match=pattern):
        call(cache)


# -- sparse decode with a token list per KV head (what double sparsity needs) --


@pytest.mark.parametrize(("hq", "hkv", "d"), [(6, 2, 32), (8, 1, 16), (32, 8, 128)])
def test_sparse_decode_with_a_token_list_per_kv_head_matches_reference(
    hq: int, hkv: int, d: int, kernel_device: str
) -> None:
    """Each KV head attends only to its own token list; -1 padding anywhere; an empty head."""
    gen = torch.Generator().manual_seed(hq * 7 + hkv)
    records, batch, width = 9, 3, 21
    kv = torch.randn(records, 2, 4, hkv, d, generator=gen).to(torch.bfloat16).to(kernel_device)
    q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16).to(kernel_device)
    slots = torch.stack(
        [
            torch.stack([torch.randperm(records * 4, generator=gen)[:width] for _ in range(hkv)])
            for _ in range(batch)
        ]
    ).to(torch.int32)
    slots[torch.rand(slots.shape, generator=gen) < 0.3] = -1
    slots[1, hkv - 1] = -1  # one (row, head) attends to nothing
    slots = slots.to(kernel_device)
    out, lse = sparse_decode(q, slots, kv, num_splits=1)
    ref_out, ref_lse = sparse_decode_reference(q, slots, kv)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    group = hq // hkv
    assert torch.isneginf(lse[1, (hkv - 1) * group :]).all()
    assert not out[1, (hkv - 1) * group :].any()


def test_sparse_decode_rejects_per_head_lists_for_another_head_count() -> None:
    """A [B, H, T] list whose H is not the cache's Hkv is refused naming the expected Hkv."""
    kv = torch.zeros(2, 2, 4, 2, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="Hkv of kv_cache"):
        sparse_decode_reference(q, torch.zeros(1, 3, 5, dtype=torch.int32), kv)


# -- resident double-sparsity decode --------------------------------------------------------------


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "c", "lengths", "heavy"),
    [
        (8, 2, 32, 6, [37, 90, 5, 61], 16),  # GQA group 4, one short (dense) row
        (16, 2, 32, 8, [45, 23], 10),  # GQA group 8
        (32, 8, 128, 16, [29, 70], 12),  # Llama-like: 32 q heads, 8 KV heads, D 128
    ],
)
def test_ds_decode_equals_plain_double_sparsity(  # noqa: PLR0917
    hq: int, hkv: int, d: int, c: int, lengths: list[int], heavy: int, kernel_device: str
) -> None:
    """Kernel and reference select the plain definition's tokens and match its attention."""
    q, ks, vs, channels = _case(lengths, hq, hkv, d, c, seed=hq + d)
    config = DSConfig(heavy_channel_num=c, heavy_token_num=heavy, sparse_decode_threshold=0)
    store = _Resident(
        ks, vs, channels, max_tokens=4 * math.ceil(max(lengths) / 4) + 4, device=kernel_device
    )
    want, chosen = _expected(q, ks, vs, channels, config, 1 / math.sqrt(d))
    for reference in (False, True):
        got = store.decode(q, config, reference=reference)
        assert _positions_as_lists(got.positions) == chosen
        torch.testing.assert_close(got.out.float().cpu(), want, atol=2e-2, rtol=2e-2)
    # the selection really is per KV head: some row has heads with different tokens
    assert any(len({tuple(h) for h in row}) > 1 for row in chosen if len(row[0]) == heavy)


class _SplitPool:
    """SGLang's MHA pool of one layer: K and V in two ``[N, Hkv, D]`` buffers, each request's
    tokens at scattered slots, and a label cache indexed by the same slots."""

    def __init__(
        self,
        ks: Sequence[torch.Tensor],
        vs: Sequence[torch.Tensor],
        channels: torch.Tensor,
        *,
        device: str,
        seed: int = 0,
    ) -> None:
        hkv, d = ks[0].shape[1:]
        total = sum(int(k.shape[0]) for k in ks)
        slots = 3 + total + 7  # room SGLang leaves: padding slots before and after
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)) + 3
        self.k = torch.zeros(slots, hkv, d, dtype=torch.bfloat16)
        self.v = torch.zeros(slots, hkv, d, dtype=torch.bfloat16)
        self.labels = LabelCache(channels.unsqueeze(0), rows=1, max_tokens=slots, device=device)
        self.lengths = [int(k.shape[0]) for k in ks]
        width = max(self.lengths)
        self.req_to_token = torch.zeros(len(ks), width, dtype=torch.int32)
        start = 0
        for b, (k, v) in enumerate(zip(ks, vs, strict=True)):
            row = order[start : start + k.shape[0]]
            start += k.shape[0]
            self.k[row], self.v[row] = k, v
            self.req_to_token[b, : k.shape[0]] = row.to(torch.int32)
            self.labels.write_slots(0, row.to(device), k.to(device))
        self.k, self.v = self.k.to(device), self.v.to(device)
        self.req_to_token = self.req_to_token.to(device)

    def decode(self, q: torch.Tensor, config: DSConfig, *, reference: bool) -> Any:
        decode = ds_decode_split_reference if reference else ds_decode_split
        return decode(
            q.to(self.k.device),
            self.k,
            self.v,
            self.labels.layer(0),
            self.labels.channels[0],
            self.req_to_token,
            self.lengths,
            config=config,
        )


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "c", "lengths", "heavy"),
    [
        (8, 2, 32, 6, [37, 90, 5, 61], 16),  # GQA group 4, one short (dense) row
        (4, 2, 16, 8, [300, 120], 64),  # the tiny Llama's geometry
    ],
)
def test_ds_decode_over_split_kv_buffers_equals_plain_double_sparsity(  # noqa: PLR0917
    hq: int, hkv: int, d: int, c: int, lengths: list[int], heavy: int, kernel_device: str
) -> None:
    """Scattered slots of separate K and V buffers, labels by the same slots: kernel and
    reference select the plain definition's tokens and match its attention, each equal bit for
    bit to its record-store counterpart (one kernel, two address maps)."""
    q, ks, vs, channels = _case(lengths, hq, hkv, d, c, seed=hq + d + 1)
    config = DSConfig(heavy_channel_num=c, heavy_token_num=heavy, sparse_decode_threshold=0)
    want, chosen = _expected(q, ks, vs, channels, config, 1 / math.sqrt(d))
    pool = _SplitPool(ks, vs, channels, device=kernel_device)
    store = _Resident(
        ks, vs, channels, max_tokens=4 * math.ceil(max(lengths) / 4) + 4, device=kernel_device
    )
    for reference in (False, True):
        got = pool.decode(q, config, reference=reference)
        assert _positions_as_lists(got.positions) == chosen
        torch.testing.assert_close(got.out.float().cpu(), want, atol=2e-2, rtol=2e-2)
        same = store.decode(q, config, reference=reference)
        assert torch.equal(got.out, same.out)
        assert torch.equal(got.lse, same.lse)


def _heavy(pool: _SplitPool, q: torch.Tensor, heavy: int, *, reference: bool) -> Any:
    """The device-length decode over the pool, with ``req_to_token`` padded past every row."""
    decode = ds_heavy_decode_split_reference if reference else ds_heavy_decode_split
    wide = torch.nn.functional.pad(pool.req_to_token, (0, 37), value=0)
    lengths = torch.tensor(pool.lengths, dtype=torch.int32, device=pool.k.device)
    return decode(
        q.to(pool.k.device),
        pool.k,
        pool.v,
        pool.labels.layer(0),
        pool.labels.channels[0],
        wide,
        lengths,
        heavy_token_num=heavy,
    )


def test_device_length_decode_equals_the_host_length_decode(kernel_device: str) -> None:
    """With the lengths on the device and the slot table wider than every row, each row keeps
    the same heavy tokens and gets the same bits as the host-length decode; a row of at most
    ``heavy`` tokens attends all of them (dense)."""
    lengths, heavy = [37, 90, 5, 61], 16
    q, ks, vs, channels = _case(lengths, 8, 2, 32, 6, seed=11)
    pool = _SplitPool(ks, vs, channels, device=kernel_device)
    config = DSConfig(heavy_channel_num=6, heavy_token_num=heavy, sparse_decode_threshold=0)
    for reference in (False, True):
        want = pool.decode(q, config, reference=reference)
        got = _heavy(pool, q, heavy, reference=reference)
        assert _positions_as_lists(got.positions) == _positions_as_lists(want.positions)
        assert _positions_as_lists(got.positions)[2] == [list(range(5))] * 2
        assert torch.equal(got.out, want.out)
        assert torch.equal(got.lse, want.lse)


@pytest.mark.gpu
def test_device_length_decode_replays_from_a_cuda_graph() -> None:
    """Captured once, the step replays for new lengths, queries and keys exactly as it runs
    eagerly: nothing in it reads the host."""
    lengths, heavy = [300, 120, 64, 1000], 64
    q, ks, vs, channels = _case(lengths, 32, 8, 128, 16, seed=12)
    pool = _SplitPool(ks, vs, channels, device="cuda")
    wide = torch.nn.functional.pad(pool.req_to_token, (0, 100), value=0)
    static_q = q.cuda()
    static_lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def step() -> Any:
        return ds_heavy_decode_split(
            static_q,
            pool.k,
            pool.v,
            pool.labels.layer(0),
            pool.labels.channels[0],
            wide,
            static_lengths,
            heavy_token_num=heavy,
        )

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    gen = torch.Generator().manual_seed(13)
    for new_lengths in ([299, 121, 65, 999], [1, 64, 65, 1000]):
        static_q.copy_(_quarters(gen, len(lengths), 32, 128).cuda())
        static_lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        pool.k.mul_(-1)  # the keys change too; the labels stay (scores only order tokens)
        graph.replay()
        eager = step()
        assert torch.equal(captured.positions, eager.positions)
        assert torch.equal(captured.out, eager.out)
        assert torch.equal(captured.lse, eager.lse)
    assert int((captured.positions[0] >= 0).sum(-1).min()) == 1  # the row of one token


def test_split_decode_refuses_value_buffers_unlike_the_keys() -> None:
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    slots = torch.zeros(1, 3, dtype=torch.int32)
    k = torch.zeros(8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"v_buffer \(8, 2, 8\) .* must match k_buffer"):
        sparse_decode_split_reference(q, slots, k, torch.zeros(8, 2, 8, dtype=torch.bfloat16))


def test_label_cache_slot_writes_equal_prompt_writes() -> None:
    gen = torch.Generator().manual_seed(3)
    channels = _channels(gen, 2, 2, 16, 4)
    k = _quarters(gen, 10, 2, 16)
    by_row = LabelCache(channels, rows=2, max_tokens=16)
    by_row.write_prompt(1, 1, k, start=2)
    by_slot = LabelCache(channels, rows=2, max_tokens=16)
    by_slot.write_slots(1, torch.arange(18, 28), k)
    assert torch.equal(by_row.buffer, by_slot.buffer)
    with pytest.raises(DSConfigError, match=r"slots \(3,\) and k \(10, 2, 16\) must agree"):
        by_slot.write_slots(0, torch.arange(3), k)


@pytest.mark.parametrize(
    "config",
    [
        DSConfig(heavy_channel_num=4, heavy_token_num=64, sparse_decode_threshold=0),
        DSConfig(heavy_channel_num=4, heavy_token_num=3, sparse_decode_threshold=64),
    ],
    ids=["heavy_covers_context", "below_threshold"],
)
def test_ds_decode_falls_back_to_dense_attention(config: DSConfig, kernel_device: str) -> None:
    """When every row fits heavy_token_num or is below the threshold, DS equals dense attention."""
    lengths = [33, 9, 50]
    q, ks, vs, channels = _case(lengths, 8, 2, 32, 4, seed=5)
    store = _Resident(ks, vs, channels, max_tokens=52, device=kernel_device)
    got = store.decode(q, config)
    for b, n in enumerate(lengths):
        assert _positions_as_lists(got.positions)[b] == [list(range(n))] * 2
        for h in range(8):
            k, v = ks[b][:, h // 4].float(), vs[b][:, h // 4].float()
            p = torch.softmax(q[b, h].float() @ k.T / math.sqrt(32), dim=0)
            torch.testing.assert_close(got.out[b, h].float().cpu(), p @ v, atol=2e-2, rtol=2e-2)


def test_ds_decode_fallback_is_per_row(kernel_device: str) -> None:
    """A short row below the threshold does not turn its long batch-mate dense."""
    lengths = [70, 12]
    q, ks, vs, channels = _case(lengths, 8, 2, 32, 4, seed=9)
    config = DSConfig(heavy_channel_num=4, heavy_token_num=8, sparse_decode_threshold=40)
    got = _Resident(ks, vs, channels, max_tokens=72, device=kernel_device).decode(q, config)
    per_row = _positions_as_lists(got.positions)
    assert [len(h) for h in per_row[0]] == [8, 8]
    assert per_row[1] == [list(range(12))] * 2
    assert got.positions.shape[2] == 12


def test_ds_positions_list_each_rows_tokens_first_then_minus_one_padding() -> None:
    """Dense and sparse rows of one batch: tokens at the front, -1 up to the batch width."""
    lengths = [70, 12, 5, 30]  # one sparse row, three dense rows of different lengths
    q, ks, vs, channels = _case(lengths, 8, 2, 32, 4, seed=11)
    config = DSConfig(heavy_channel_num=4, heavy_token_num=8, sparse_decode_threshold=40)
    store = _Resident(ks, vs, channels, max_tokens=72, device="cpu")
    positions = ds_positions(
        q,
        store.labels.layer(0),
        store.labels.channels[0],
        store.req_to_token,
        lengths,
        config=config,
        reference=True,
    )
    assert positions.dtype == torch.int32
    assert tuple(positions.shape) == (4, 2, 30)  # width = longest dense row
    pad = torch.full((2, 22), -1, dtype=torch.int32)
    sparse = positions[0, :, :8]
    assert bool((sparse >= 0).all())
    assert bool((sparse[:, 1:] > sparse[:, :-1]).all())
    assert torch.equal(positions[0, :, 8:], pad)
    for b, n in enumerate(lengths[1:], start=1):
        want = torch.full((2, 30), -1, dtype=torch.int32)
        want[:, :n] = torch.arange(n, dtype=torch.int32)
        assert torch.equal(positions[b], want), b


def test_fixed_width_positions_equal_the_host_length_positions_padded(kernel_device: str) -> None:
    """With the lengths on the device, each row (dense at most heavy tokens, dense below the
    threshold, sparse) lists what ds_positions lists, padded with -1 to the fixed width."""
    lengths = [5, 25, 60, 90]
    q, ks, vs, channels = _case(lengths, 8, 2, 32, 6, seed=21)
    config = DSConfig(heavy_channel_num=6, heavy_token_num=8, sparse_decode_threshold=40)
    pool = _Resident(ks, vs, channels, max_tokens=128, device=kernel_device)
    slots = pool.labels.slots(range(len(lengths)), 128)
    args = (q.to(kernel_device), pool.labels.layer(0), pool.labels.channels[0], slots)
    want = ds_positions(*args, lengths, config=config)
    seq_lens = torch.tensor(lengths, device=kernel_device)
    got = ds_positions_fixed(*args, seq_lens, config=config)
    assert tuple(got.shape) == (4, 2, config.fixed_width()) == (4, 2, 39)
    assert torch.equal(got[..., : want.shape[2]], want)
    assert bool((got[..., want.shape[2] :] == -1).all())
    assert _positions_as_lists(got)[1] == [list(range(25))] * 2  # dense below the threshold


def test_a_slot_table_narrower_than_the_fixed_width_lists_every_row_densely(
    kernel_device: str,
) -> None:
    """Rows of at most S < fixed_width() tokens are all dense: each lists its whole context at
    the fixed width, as ds_positions does (padded), with no token scored."""
    lengths = [5, 25, 30]
    q, ks, vs, channels = _case(lengths, 8, 2, 32, 6, seed=22)
    config = DSConfig(heavy_channel_num=6, heavy_token_num=8, sparse_decode_threshold=40)
    pool = _Resident(ks, vs, channels, max_tokens=32, device=kernel_device)
    slots = pool.labels.slots(range(len(lengths)), 30)
    args = (q.to(kernel_device), pool.labels.layer(0), pool.labels.channels[0], slots)
    want = ds_positions(*args, lengths, config=config)
    got = ds_positions_fixed(*args, torch.tensor(lengths, device=kernel_device), config=config)
    assert tuple(got.shape) == (3, 2, config.fixed_width()) == (3, 2, 39)
    assert torch.equal(got[..., :30], want)
    assert bool((got[..., 30:] == -1).all())
    assert _positions_as_lists(got)[0] == [list(range(5))] * 2


def test_ds_decode_rejects_lengths_outside_the_slot_table(kernel_device: str) -> None:
    """seq_lens beyond req_to_token's width (or zero) are refused with the bound."""
    q, ks, vs, channels = _case([8], 4, 2, 16, 4, seed=3)
    store = _Resident(ks, vs, channels, max_tokens=8, device=kernel_device)
    with pytest.raises(KernelInputError, match=r"seq_lens\[0\]=9 .*\[1, 8\]"):
        ds_decode_reference(
            q,
            store.kv,
            store.labels.layer(0),
            store.labels.channels[0],
            store.req_to_token,
            [9],
            config=DSConfig(),
        )


# -- DS-Offload -----------------------------------------------------------------------------------


def _offload_run(
    *,
    hq: int,
    hkv: int,
    d: int,
    prompts: Sequence[int],
    steps: int,
    config: DSConfig,
    hot_slots: int,
    device: str,
    kv_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> int:
    """Run DS-Offload and resident DS side by side for ``steps`` decode steps; return checks."""
    gen = torch.Generator().manual_seed(seed)
    layers, rows = 2, len(prompts) + 1
    max_blocks = math.ceil((max(prompts) + steps) / 4) + 1
    channels = _channels(gen, layers, hkv, d, config.heavy_channel_num)
    geometry = OffloadGeometry(layers, rows, hot_slots, max_blocks, hkv, d, kv_dtype, per_head=True)
    store = DSOffloadedKV(geometry, channels, config=config, device=device)
    live = list(range(1, rows))  # row 0 stays free
    hist_k: dict[int, torch.Tensor] = {}
    hist_v: dict[int, torch.Tensor] = {}
    for row, n in zip(live, prompts, strict=True):
        hist_k[row] = _quarters(gen, layers, n, hkv, d).to(kv_dtype)
        hist_v[row] = torch.randn(layers, n, hkv, d, generator=gen).to(kv_dtype)
        store.admit(row, hist_k[row].to(device), hist_v[row].to(device))
    checks = 0
    for _ in range(steps):
        store.begin_step()
        new_k = _quarters(gen, layers, len(live), hkv, d).to(kv_dtype)
        new_v = torch.randn(layers, len(live), hkv, d, generator=gen).to(kv_dtype)
        store.append(live, new_k.to(device), new_v.to(device))
        for i, row in enumerate(live):
            hist_k[row] = torch.cat([hist_k[row], new_k[:, i : i + 1]], dim=1)
            hist_v[row] = torch.cat([hist_v[row], new_v[:, i : i + 1]], dim=1)
        for layer in range(layers):
            q = _quarters(gen, len(live), hq, d).to(device)
            got = store.decode(layer, live, q)
            resident = _Resident(
                [hist_k[r][layer] for r in live],
                [hist_v[r][layer] for r in live],
                channels[layer],
                max_tokens=geometry.max_tokens,
                device=device,
                kv_dtype=kv_dtype,
            )
            want = resident.decode(q, config)
            assert torch.equal(got.positions, want.positions)
            torch.testing.assert_close(got.out.float(), want.out.float(), atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(got.lse, want.lse, atol=1e-3, rtol=1e-3)
            checks += 1
    return checks


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "heavy", "kv_dtype"),
    [
        (8, 2, 32, 6, torch.bfloat16),  # group 4
        (16, 2, 16, 5, torch.float8_e4m3fn),  # group 8, FP8 K/V
    ],
)
def test_ds_offload_equals_resident_ds(  # noqa: PLR0917
    hq: int, hkv: int, d: int, heavy: int, kv_dtype: torch.dtype, kernel_device: str
) -> None:
    """Prompts of different lengths, steps across block boundaries: offload == resident."""
    config = DSConfig(heavy_channel_num=4, heavy_token_num=heavy, sparse_decode_threshold=0)
    checks = _offload_run(
        hq=hq,
        hkv=hkv,
        d=d,
        prompts=[29, 6, 42],
        steps=5,
        config=config,
        hot_slots=heavy,
        device=kernel_device,
        kv_dtype=kv_dtype,
        seed=hq,
    )
    assert checks == 10


def test_ds_offload_dense_rows_and_a_small_hot_cache(kernel_device: str) -> None:
    """Dense rows (below the threshold) fetch all their blocks; LRU reuse stays exact."""
    config = DSConfig(heavy_channel_num=4, heavy_token_num=4, sparse_decode_threshold=20)
    checks = _offload_run(
        hq=4,
        hkv=2,
        d=16,
        prompts=[14, 3, 33],
        steps=6,
        config=config,
        hot_slots=8,
        device=kernel_device,
        seed=3,
    )
    assert checks == 12


def _twin_stores(
    config: DSConfig, prompts: Sequence[int], device: str, seed: int
) -> tuple[list[DSOffloadedKV], torch.Generator, list[int]]:
    """Two DS-Offload stores holding the same prompts (rows 1.., row 0 free)."""
    gen = torch.Generator().manual_seed(seed)
    layers, hkv, d = 2, 2, 16
    channels = _channels(gen, layers, hkv, d, config.heavy_channel_num)
    geometry = OffloadGeometry(
        layers, len(prompts) + 1, config.hot_blocks(), 16, hkv, d, torch.bfloat16, per_head=True
    )
    stores = [DSOffloadedKV(geometry, channels, config=config, device=device) for _ in range(2)]
    for row, n in enumerate(prompts, start=1):
        k, v = _quarters(gen, layers, n, hkv, d), _quarters(gen, layers, n, hkv, d)
        for store in stores:
            store.admit(row, k.to(device), v.to(device))
    return stores, gen, list(range(1, len(prompts) + 1))


def test_ds_offload_fixed_shape_decode_equals_the_host_sized_decode(kernel_device: str) -> None:
    """decode_fixed (device lengths, fixed widths, no host read) attends decode's tokens, for a
    sparse row, a dense row within heavy tokens and one below the threshold."""
    config = DSConfig(heavy_channel_num=4, heavy_token_num=6, sparse_decode_threshold=20)
    (eager, fixed), gen, rows = _twin_stores(config, [29, 5, 14], kernel_device, seed=31)
    for _ in range(6):  # blocks close; the 14-token row crosses the threshold
        k = _quarters(gen, 2, len(rows), 2, 16).to(kernel_device)
        v = _quarters(gen, 2, len(rows), 2, 16).to(kernel_device)
        for store in (eager, fixed):
            store.begin_step()
            store.append(rows, k, v)
        for layer in range(2):
            q = _quarters(gen, len(rows), 4, 16).to(kernel_device)
            want = eager.decode(layer, rows, q)
            got = fixed.decode_fixed(layer, rows, q)
            assert got.positions.shape[2] == config.fixed_width()
            assert torch.equal(got.positions[..., : want.positions.shape[2]], want.positions)
            # The same tokens; the wider lists split the kernel's work otherwise, so the fp32
            # partials merge in another order: one bf16 step of the output at most.
            torch.testing.assert_close(got.out.float(), want.out.float(), atol=4e-3, rtol=0)
            torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=1e-5)


def test_ds_offload_triton_path_attends_the_reference_paths_tokens(
    interpreter_device: str,
) -> None:
    """The Triton data path (per-head blocks and key rows, fetch, decode) and the torch one
    choose the same tokens and attend them alike, step after step, dense and sparse rows."""
    config = DSConfig(heavy_channel_num=4, heavy_token_num=6, sparse_decode_threshold=20)
    gen = torch.Generator().manual_seed(17)
    layers, hkv, d, prompts = 2, 2, 16, [29, 5, 14]
    channels = _channels(gen, layers, hkv, d, config.heavy_channel_num)
    geometry = OffloadGeometry(
        layers, len(prompts) + 1, config.hot_blocks(), 16, hkv, d, torch.bfloat16, per_head=True
    )
    stores = [
        DSOffloadedKV(geometry, channels, config=config, device=interpreter_device, path=path)
        for path in (KernelPath.TRITON, KernelPath.REFERENCE)
    ]
    rows = list(range(1, len(prompts) + 1))
    for row, n in zip(rows, prompts, strict=True):
        k, v = _quarters(gen, layers, n, hkv, d), _quarters(gen, layers, n, hkv, d)
        for store in stores:
            store.admit(row, k, v)
    for _ in range(5):  # blocks close; the 14-token row crosses the threshold
        k, v = _quarters(gen, layers, len(rows), hkv, d), _quarters(gen, layers, len(rows), hkv, d)
        for store in stores:
            store.begin_step()
            store.append(rows, k, v)
        for layer in range(layers):
            q = _quarters(gen, len(rows), 4, d)
            got, want = (store.decode_fixed(layer, rows, q) for store in stores)
            assert torch.equal(got.positions, want.positions)
            torch.testing.assert_close(got.out.float(), want.out.float(), atol=4e-3, rtol=0)
            torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=1e-5)


def test_ds_offload_fixed_shape_decode_refuses_hot_caches_below_the_bound() -> None:
    """A fixed-shape step cannot count blocks on the host, so it needs hot_blocks() slots."""
    config = DSConfig(heavy_channel_num=4, heavy_token_num=8, sparse_decode_threshold=0)
    geometry = OffloadGeometry(1, 1, 2, 16, 1, 16, torch.bfloat16, per_head=True)
    store = DSOffloadedKV(
        geometry, torch.zeros(1, 1, 4, dtype=torch.int32), config=config, device="cpu"
    )
    store.begin_step()
    with pytest.raises(KernelInputError, match=r"hot_slots=2 .*hot_blocks\(\)=8"):
        store.decode_fixed(0, [0], torch.zeros(1, 4, 16, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_ds_offload_fixed_shape_decode_replays_from_a_cuda_graph() -> None:
    """Every layer's decode_fixed captured once replays step after step (new lengths, blocks
    closing, hot-cache misses) exactly as its eager twin runs."""
    config = DSConfig(heavy_channel_num=8, heavy_token_num=16, sparse_decode_threshold=64)
    (eager, graphed), gen, rows = _twin_stores(config, [40, 9, 58], "cuda", seed=41)
    static_q = torch.zeros(2, len(rows), 4, 16, dtype=torch.bfloat16, device="cuda")
    outputs: list[Any] = []

    def layers(store: DSOffloadedKV) -> list[Any]:
        return [store.decode_fixed(layer, rows, static_q[layer]) for layer in range(2)]

    graph = torch.cuda.CUDAGraph()
    for step in range(5):
        k = _quarters(gen, 2, len(rows), 2, 16).cuda()
        v = _quarters(gen, 2, len(rows), 2, 16).cuda()
        static_q.copy_(_quarters(gen, 2, len(rows), 4, 16).cuda())
        for store in (eager, graphed):
            store.begin_step()
            store.append(rows, k, v)
        want = layers(eager)  # compiles every kernel before the capture, too
        if step == 0:
            with torch.cuda.graph(graph):
                outputs = layers(graphed)
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip(outputs, want, strict=True):
            assert torch.equal(got.positions, expected.positions), step
            assert torch.equal(got.out, expected.out), step
            assert torch.equal(got.lse, expected.lse), step


def test_ds_offload_rejects_a_hot_cache_smaller_than_the_step_needs() -> None:
    """A step needing more distinct blocks than hot_slots raises and names both numbers."""
    config = DSConfig(heavy_channel_num=4, heavy_token_num=8, sparse_decode_threshold=0)
    geometry = OffloadGeometry(1, 1, 2, 16, 1, 16, torch.bfloat16, per_head=True)
    store = DSOffloadedKV(
        geometry, torch.zeros(1, 1, 4, dtype=torch.int32), config=config, device="cpu"
    )
    gen = torch.Generator().manual_seed(0)
    store.admit(0, _quarters(gen, 1, 40, 1, 16), _quarters(gen, 1, 40, 1, 16))
    store.begin_step()
    store.append([0], _quarters(gen, 1, 1, 1, 16), _quarters(gen, 1, 1, 1, 16))
    with pytest.raises(KernelInputError, match=r"needs \d+ distinct blocks .*hot_slots=2"):
        store.decode(0, [0], _quarters(gen, 1, 4, 16))


def test_ds_offload_refuses_records_of_every_head_and_sizes_hot_caches_per_head() -> None:
    """DS-Offload needs per-head records; a head's hot cache covers its heavy tokens' blocks or
    a dense row's context."""
    geometry = OffloadGeometry(1, 1, 4, 4, 2, 16, torch.bfloat16)
    with pytest.raises(KernelInputError, match="per_head=False"):
        DSOffloadedKV(
            geometry, torch.zeros(1, 2, 4, dtype=torch.int32), config=DSConfig(), device="cpu"
        )
    assert DSConfig(heavy_token_num=256, sparse_decode_threshold=2048).hot_blocks() == 511
    assert DSConfig(heavy_token_num=256, sparse_decode_threshold=0).hot_blocks() == 256


def test_ds_offload_decode_needs_a_step() -> None:
    """decode before begin_step is refused."""
    geometry = OffloadGeometry(1, 1, 4, 4, 1, 16, torch.bfloat16, per_head=True)
    store = DSOffloadedKV(
        geometry, torch.zeros(1, 1, 4, dtype=torch.int32), config=DSConfig(), device="cpu"
    )
    with pytest.raises(KernelInputError, match="begin_step"):
        store.decode(0, [0], torch.zeros(1, 4, 16, dtype=torch.bfloat16))


# -- full size (GPU) ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_full_size_llama_ds_decode_and_offload() -> None:
    """Llama-3.1-8B geometry, 4K/3K/1K contexts, 32 channels, 256 tokens: kernel == reference,
    offload == resident."""
    lengths = [4096, 3001, 1030]
    q, ks, vs, channels = _case(lengths, 32, 8, 128, 32, seed=11)
    config = DSConfig(heavy_channel_num=32, heavy_token_num=256, sparse_decode_threshold=2048)
    store = _Resident(ks, vs, channels, max_tokens=4100, device="cuda")
    got = store.decode(q, config)
    ref = store.decode(q, config, reference=True)
    assert torch.equal(got.positions, ref.positions)
    torch.testing.assert_close(got.out.float(), ref.out.float(), atol=2e-2, rtol=2e-2)
    checks = _offload_run(
        hq=32,
        hkv=8,
        d=128,
        prompts=[4093, 2050],
        steps=2,
        config=config,
        hot_slots=config.hot_blocks(),
        device="cuda",
    )
    assert checks == 4
