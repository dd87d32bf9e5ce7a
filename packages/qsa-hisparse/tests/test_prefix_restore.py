"""A prefix restored from the host prefix cache continues exactly as the uncached run.

Request A is prefilled into row 0 of an :class:`~qsa_kernels.offload.OffloadedKV` and decodes a
few steps; its first complete pages are published to a :class:`~qsa_hostcache.HostPrefixCache`
(raw K/V records and compressed index keys, the state a QSA checkpoint carries besides the
recurrent layers). Request B shares A's first pages and then diverges. B is served twice: once
uncached in row 2 (every token prefilled) and once in row 1 from the cache (the match restored,
only the rest prefilled). Decoding both side by side must give bit-identical selections, outputs
and LSE at every layer and step.

The "model" is a table: a token's K/V and index key depend only on its id and position, so equal
prefixes give equal state, as they do in a real model.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from qsa_hostcache import CacheNamespace, HostPrefixCache, PrefixKey
from qsa_kernels.indexer_topk import indexer_topk
from qsa_kernels.offload import OffloadedKV, OffloadGeometry

_INDEX_DIM = 128
_BLOCKS_PER_PAGE = 16


@dataclass(frozen=True)
class Case:
    """Sizes of one run."""

    layers: int
    q_heads: int
    head_dim: int
    topk: int
    hot_slots: int
    page_size: int  # prefix-cache page, tokens (a multiple of 4)
    prompt_a: int
    shared: int  # tokens B shares with A
    prompt_b: int
    steps: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        # A checkpoint matches only as a whole, so B must contain every page A publishes.
        published = self.prompt_a // self.page_size * self.page_size
        assert self.shared >= published, (self.shared, published)


SMALL = Case(2, 4, 32, 4, 6, 16, 45, 40, 57, 4, torch.bfloat16)
QWEN_TP2 = Case(12, 12, 256, 512, 2048, 64, 9_001, 8_990, 12_345, 6, torch.float8_e4m3fn)


class TableModel:
    """K/V and index keys as a deterministic function of (token id, position)."""

    def __init__(self, case: Case, device: torch.device, vocab: int = 97) -> None:
        gen = torch.Generator().manual_seed(5)
        self.case = case
        self.device = device
        self.kv = torch.randn(vocab, case.layers, 2, 1, case.head_dim, generator=gen).to(device)
        self.index = torch.randn(vocab, case.layers, _INDEX_DIM, generator=gen).to(device)

    def kv_of(self, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[L, T, 1, D]`` K and V of ``tokens`` placed at positions ``start..``."""
        pos = torch.arange(start, start + tokens.numel(), device=self.device)
        scale = (1.0 + 1e-3 * pos).view(1, -1, 1, 1)
        kv = self.kv[tokens].permute(1, 2, 0, 3, 4)  # [L, 2, T, 1, D]
        return (kv[:, 0] * scale).to(self.case.dtype), (kv[:, 1] * scale).to(self.case.dtype)

    def index_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[L, blocks, 128]`` bf16 compressed index keys of the complete blocks of ``tokens``."""
        blocks = tokens.numel() // 4
        per_block = self.index[tokens[: 4 * blocks]].view(blocks, 4, self.case.layers, _INDEX_DIM)
        return per_block.mean(dim=1).permute(1, 0, 2).bfloat16().contiguous()


def _run(case: Case, device: torch.device) -> None:
    model = TableModel(case, device)
    gen = torch.Generator().manual_seed(11)
    prompt_a = torch.randint(0, 97, (case.prompt_a,), generator=gen)
    prompt_b = torch.cat(
        [
            prompt_a[: case.shared],
            torch.randint(0, 97, (case.prompt_b - case.shared,), generator=gen),
        ]
    )
    max_tokens = max(case.prompt_a, case.prompt_b) + case.steps
    max_blocks = -(-max_tokens // 4)
    pages = -(-max_blocks // _BLOCKS_PER_PAGE)
    store = OffloadedKV(
        OffloadGeometry(case.layers, 3, case.hot_slots, max_blocks, 1, case.head_dim, case.dtype),
        device,
    )
    # Compressed index keys, per layer, rows laid out in pages of 16 blocks.
    index = torch.zeros(case.layers, 3 * pages * _BLOCKS_PER_PAGE, _INDEX_DIM, device=device)
    index = index.bfloat16()
    page_table = torch.arange(3 * pages, dtype=torch.int32, device=device).view(3, pages)

    def set_index(row: int, first_block: int, keys: torch.Tensor) -> None:
        base = row * pages * _BLOCKS_PER_PAGE + first_block
        index[:, base : base + keys.shape[1]] = keys

    def row_index(row: int, blocks: int) -> torch.Tensor:
        base = row * pages * _BLOCKS_PER_PAGE
        return index[:, base : base + blocks].contiguous()

    # Request A: prefill row 0, publish its first complete pages.
    k, v = model.kv_of(prompt_a.to(device), 0)
    store.admit(0, k, v)
    set_index(0, 0, model.index_of(prompt_a.to(device)))
    namespace = CacheNamespace(
        model="table-model", dtype=str(case.dtype), tp_size=1, tp_rank=0, config_digest="t"
    )
    cache = HostPrefixCache(256 << 20, max_entries=8, page_size=case.page_size)
    pages_a = case.prompt_a // case.page_size
    blocks_a = pages_a * case.page_size // 4
    key_a = PrefixKey(namespace, prompt_a.tolist(), page_size=case.page_size)
    ticket = cache.publish(
        key_a.prefix(pages_a),
        {
            "raw_kv": store.export_prefix(0, blocks_a),
            "index_k": row_index(0, blocks_a).cpu(),
        },
        wait=True,
    )
    assert ticket is not None

    # Request B, uncached: row 2 prefills every token.
    k, v = model.kv_of(prompt_b.to(device), 0)
    store.admit(2, k, v)
    set_index(2, 0, model.index_of(prompt_b.to(device)))

    # Request B, cached: row 1 restores the match and prefills only the rest.
    lease = cache.acquire(
        PrefixKey(namespace, prompt_b.tolist(), page_size=case.page_size),
        max_tokens=case.prompt_b - 1,
    )
    assert lease is not None
    cached = lease.match.num_tokens
    assert cached == case.shared // case.page_size * case.page_size
    blocks = cached // 4
    raw = torch.empty(case.layers, blocks_a, *store.geometry.record_shape, dtype=case.dtype)
    idx = torch.empty(case.layers, blocks_a, _INDEX_DIM, dtype=torch.bfloat16)
    with lease:
        cache.restore(lease, {"raw_kv": raw, "index_k": idx}).synchronize()
    # The checkpoint covers A's published pages; B uses the part the match vouches for.
    k, v = model.kv_of(prompt_b[cached:].to(device), cached)
    store.admit(1, k, v, prefix=raw[:, :blocks])
    set_index(1, 0, idx[:, :blocks].to(device))
    set_index(1, blocks, model.index_of(prompt_b.to(device))[:, blocks:])

    # Decode rows 1 and 2 side by side with the same new tokens and queries.
    lengths = [case.prompt_b, case.prompt_b]
    for step in range(case.steps):
        token = torch.randint(0, 97, (1,), generator=gen).to(device)
        k, v = model.kv_of(token, lengths[0])
        store.append([1, 2], torch.cat([k, k], dim=1), torch.cat([v, v], dim=1))
        lengths = [n + 1 for n in lengths]
        if lengths[0] % 4 == 0:  # a block closed: its index key joins both rows
            block = lengths[0] // 4 - 1
            key = model.index_of(torch.cat([prompt_b, token.cpu()])[-4:].to(device))
            set_index(1, block, key)
            set_index(2, block, key)
        prompt_b = torch.cat([prompt_b, token.cpu()])
        store.begin_step()
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        for layer in range(case.layers):
            qi = (
                torch.randn(1, 4, _INDEX_DIM, generator=gen).bfloat16().to(device).expand(2, -1, -1)
            )
            blocks_sel = indexer_topk(
                qi.contiguous(),
                index[layer].view(-1, _BLOCKS_PER_PAGE, _INDEX_DIM),
                page_table[1:],
                seq_lens,
                topk=case.topk,
            )
            assert torch.equal(blocks_sel[0], blocks_sel[1]), f"step {step} layer {layer}"
            q = torch.randn(1, case.q_heads, case.head_dim, generator=gen).bfloat16().to(device)
            out, lse = store.attend(layer, [1, 2], q.expand(2, -1, -1).contiguous(), blocks_sel)
            assert torch.equal(out[0], out[1]), f"step {step} layer {layer}"
            assert torch.equal(lse[0], lse[1]), f"step {step} layer {layer}"
    stats = cache.stats()
    assert stats.hits == 1
    assert stats.hit_tokens == cached


def test_restored_prefix_continues_exactly_on_cpu_interpreter() -> None:
    """Small shapes under Triton's interpreter: cached and uncached rows decode identically."""
    if torch.cuda.is_available():
        pytest.skip("the GPU variant covers this where CUDA exists")
    _run(SMALL, torch.device("cpu"))


@pytest.mark.gpu
def test_restored_prefix_continues_exactly_at_qwen38_shapes() -> None:
    """All 12 QSA layers at TP2 shapes, FP8, pinned arenas: cached equals uncached, bit for bit."""
    _run(QWEN_TP2, torch.device("cuda"))
