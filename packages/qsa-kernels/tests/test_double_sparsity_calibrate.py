"""The calibration pass: each head's channels ranked by their mean activation, loadable as is."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from qsa_kernels.double_sparsity import (
    ChannelConfig,
    DSConfig,
    DSConfigError,
    HeavyChannelType,
    calibrate_channels,
    layer_key,
)

Q_HEADS, KV_HEADS, DIM, LAYERS = 4, 2, 8, 2


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(16, Q_HEADS * DIM, bias=False)
        self.k_proj = torch.nn.Linear(16, KV_HEADS * DIM, bias=False)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()


class _Body(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(LAYERS))

    def attention(self) -> list[_Attention]:
        return [cast(_Layer, layer).self_attn for layer in self.layers]


class _Decoder(torch.nn.Module):
    """The module layout of a Hugging Face decoder: embeddings, then layers with q/k projections."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Body()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.model.embed(input_ids)
        for attn in self.model.attention():
            h = h + attn.q_proj(h)[..., :16] + attn.k_proj(h)
        return h


def _decoder(loud_k_channel: int, loud_q_channel: int) -> _Decoder:
    """A decoder whose KV head 1 channel ``loud_k_channel`` and query head 2 channel
    ``loud_q_channel`` are 100 times larger than the rest."""
    torch.manual_seed(0)
    model = _Decoder().eval()
    with torch.no_grad():
        for attn in model.model.attention():
            attn.k_proj.weight[1 * DIM + loud_k_channel] *= 100
            attn.q_proj.weight[2 * DIM + loud_q_channel] *= 100
    return model


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 24), generator=gen) for _ in range(3)]


@pytest.mark.parametrize("kind", list(HeavyChannelType))
def test_the_loudest_channel_of_a_head_ranks_first(kind: HeavyChannelType) -> None:
    result = calibrate_channels(
        _decoder(loud_k_channel=5, loud_q_channel=3),
        _batches(),
        channel_type=kind,
        num_q_heads=Q_HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
    )
    assert sorted(result) == [layer_key(i, kind) for i in range(LAYERS)]
    for rows in result.values():
        assert len(rows) == (KV_HEADS if kind is HeavyChannelType.K else Q_HEADS)
        assert all(sorted(row) == list(range(DIM)) for row in rows)
        if kind is HeavyChannelType.K:
            assert rows[1][0] == 5
        elif kind is HeavyChannelType.Q:
            assert rows[2][0] == 3
        else:  # query heads 2 and 3 share KV head 1: its loud key channel leads both products,
            # and query head 2's own loud channel is level with it
            assert rows[3][0] == 5
            assert set(rows[2][:2]) == {3, 5}


def test_the_result_loads_as_a_channel_config_reduced_per_kv_group() -> None:
    data = calibrate_channels(
        _decoder(loud_k_channel=6, loud_q_channel=6),
        _batches(),
        channel_type="qk",
        num_q_heads=Q_HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
    )
    config = DSConfig(heavy_channel_num=2, heavy_token_num=16)
    loaded = ChannelConfig.from_mapping(
        data,
        config=config,
        layers=range(LAYERS),
        num_q_heads=Q_HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
    )
    assert loaded.channels.shape == (LAYERS, KV_HEADS, 2)
    assert loaded.channels[:, 1, 0].tolist() == [6] * LAYERS


def test_progress_counts_every_token() -> None:
    seen: list[int] = []
    calibrate_channels(
        _decoder(0, 0),
        _batches(),
        channel_type="k",
        num_q_heads=Q_HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        on_batch=seen.append,
    )
    assert seen == [48, 48, 48]


def test_a_model_without_the_decoder_layout_is_refused_by_name() -> None:
    with pytest.raises(DSConfigError, match=r"Linear has no model\.layers"):
        calibrate_channels(
            torch.nn.Linear(2, 2),
            _batches(),
            channel_type="k",
            num_q_heads=Q_HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=DIM,
        )


def test_a_decoder_without_layers_is_refused() -> None:
    model = _decoder(0, 0)
    model.model.layers = torch.nn.ModuleList()
    with pytest.raises(DSConfigError, match="_Decoder has no layers"):
        calibrate_channels(
            model, _batches(), channel_type="k", num_q_heads=4, num_kv_heads=2, head_dim=8
        )


def test_no_tokens_and_bad_shapes_are_refused() -> None:
    with pytest.raises(DSConfigError, match="saw no tokens"):
        calibrate_channels(
            _decoder(0, 0), [], channel_type="k", num_q_heads=4, num_kv_heads=2, head_dim=8
        )
    with pytest.raises(DSConfigError, match="num_q_heads=4 must be a multiple of num_kv_heads=3"):
        calibrate_channels(
            _decoder(0, 0), [], channel_type="k", num_q_heads=4, num_kv_heads=3, head_dim=8
        )
    with pytest.raises(DSConfigError, match="head_dim=0 is not allowed"):
        calibrate_channels(
            _decoder(0, 0), [], channel_type="k", num_q_heads=4, num_kv_heads=2, head_dim=0
        )
    with pytest.raises(DSConfigError, match="heavy_channel_type='v'"):
        calibrate_channels(
            _decoder(0, 0), [], channel_type="v", num_q_heads=4, num_kv_heads=2, head_dim=8
        )
