"""Double-sparsity options and the heavy-channel calibration loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsa_kernels._errors import KernelInputError
from qsa_kernels.double_sparsity import (
    CHANNEL_CONFIG_MAX_BYTES,
    ChannelConfig,
    ChannelConfigError,
    DSConfig,
    DSConfigError,
    HeavyChannelType,
    layer_key,
    reduce_group_channels,
)
from qsa_pytest.refusals import malformed_json

D = 16


def _ranking(seed: int, d: int = D) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randperm(d, generator=g)]


def _file_data(layers: int, heads: int, kind: str = "k") -> dict[str, Any]:
    return {
        f"model.layers.{i}.self_attn.{kind}_proj": [_ranking(100 * i + h) for h in range(heads)]
        for i in range(layers)
    }


def _load(data: object, **overrides: Any) -> ChannelConfig:
    kwargs: dict[str, Any] = {
        "config": DSConfig(heavy_channel_num=4, heavy_channel_type=HeavyChannelType.K),
        "layers": range(2),
        "num_q_heads": 4,
        "num_kv_heads": 2,
        "head_dim": D,
    }
    kwargs.update(overrides)
    return ChannelConfig.from_mapping(data, source="calib.json", **kwargs)


def test_defaults_are_the_original_server_defaults() -> None:
    """Defaults: 32 heavy channels, 256 heavy tokens, qk ranking, threshold 4096 tokens."""
    cfg = DSConfig()
    assert (cfg.heavy_channel_num, cfg.heavy_token_num) == (32, 256)
    assert cfg.heavy_channel_type is HeavyChannelType.QK
    assert cfg.sparse_decode_threshold == 4096


def test_channel_type_string_is_parsed() -> None:
    """A string type is turned into its enum member once, at construction."""
    assert DSConfig(heavy_channel_type="k").heavy_channel_type is HeavyChannelType.K  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("heavy_channel_num", 0),
        ("heavy_token_num", -3),
        ("sparse_decode_threshold", -1),
        ("heavy_token_num", True),
        ("heavy_channel_num", 2.0),
        ("heavy_channel_type", "qq"),
    ],
)
def test_bad_option_is_rejected_with_its_name_and_value(field: str, value: object) -> None:
    """Each bad option raises DSConfigError (a ValueError) naming the option and the value."""
    with pytest.raises(DSConfigError, match=field) as info:
        DSConfig(**{field: value})  # type: ignore[arg-type]
    assert repr(value) in str(info.value)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KernelInputError)


def test_unknown_type_lists_the_allowed_ones() -> None:
    """An unknown heavy channel type names q, k and qk."""
    with pytest.raises(DSConfigError, match=r"\('q', 'k', 'qk'\)"):
        HeavyChannelType.parse("v")


def test_dense_decision_follows_threshold_and_heavy_token_num() -> None:
    """Dense below the threshold and when the context fits in heavy_token_num; sparse otherwise."""
    cfg = DSConfig(heavy_token_num=8, sparse_decode_threshold=20)
    assert [cfg.is_dense(n) for n in (1, 8, 9, 19, 20, 21)] == [
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    cfg0 = DSConfig(heavy_token_num=8, sparse_decode_threshold=0)
    assert [cfg0.is_dense(n) for n in (8, 9)] == [True, False]


@pytest.mark.parametrize(("heavy", "threshold"), [(8, 20), (8, 0), (30, 20)])
def test_device_sparse_rows_are_the_rows_that_are_not_dense(heavy: int, threshold: int) -> None:
    cfg = DSConfig(heavy_token_num=heavy, sparse_decode_threshold=threshold)
    lengths = list(range(1, 40))
    got = cfg.sparse_rows(torch.tensor(lengths, dtype=torch.int32))
    assert got.dtype == torch.bool
    assert got.tolist() == [not cfg.is_dense(n) for n in lengths]


def test_kv_head_rows_are_cut_to_heavy_channel_num() -> None:
    """Rows per KV head keep their first heavy_channel_num channels, in rank order, as int32."""
    data = _file_data(2, 2)
    cfg = _load(data)
    assert cfg.channels.dtype == torch.int32
    assert tuple(cfg.channels.shape) == (2, 2, 4)
    for i in range(2):
        key = layer_key(i, HeavyChannelType.K)
        assert cfg.channels[i].tolist() == [row[:4] for row in data[key]]
    assert cfg.layer_channels(1).tolist() == cfg.channels[1].tolist()


def test_query_head_rows_are_reduced_to_their_kv_head() -> None:
    """Rows per query head are merged per KV group by rank-weighted votes."""
    data = {
        "model.layers.0.self_attn.q_proj": [
            [5, 1, 2, 3, 9],
            [5, 2, 1, 7, 8],  # group 0 agrees on 5, then 1 and 2 tie on votes
            [0, 1, 2, 3, 4],
            [0, 1, 2, 3, 4],
        ]
    }
    cfg = _load(
        data,
        config=DSConfig(heavy_channel_num=3, heavy_channel_type="q"),  # type: ignore[arg-type]
        layers=[0],
    )
    assert cfg.channels[0].tolist() == [[5, 1, 2], [0, 1, 2]]


def test_load_reads_the_json_file(tmp_path: Path) -> None:
    """load() reads the file and records its path."""
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(_file_data(3, 4, "qk")))
    cfg = ChannelConfig.load(
        path,
        config=DSConfig(heavy_channel_num=5),
        layers=[0, 2],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=D,
    )
    assert cfg.source == str(path)
    assert cfg.layers == (0, 2)
    assert tuple(cfg.channels.shape) == (2, 2, 5)


_LOAD_KWARGS: dict[str, Any] = {
    "config": DSConfig(),
    "layers": [0],
    "num_q_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
}


def test_unreadable_and_non_json_files_name_the_file(tmp_path: Path) -> None:
    """A missing file, a directory and a non-JSON file raise ChannelConfigError naming the path."""
    with pytest.raises(ChannelConfigError, match=r"nope\.json'?: no such file"):
        ChannelConfig.load(tmp_path / "nope.json", **_LOAD_KWARGS)
    with pytest.raises(ChannelConfigError, match="is a directory"):
        ChannelConfig.load(tmp_path, **_LOAD_KWARGS)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ChannelConfigError, match=r"bad\.json' is not JSON"):
        ChannelConfig.load(bad, **_LOAD_KWARGS)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=malformed_json())
def test_a_malformed_file_is_refused_naming_it_not_with_a_parser_error(
    tmp_path: Path, content: bytes
) -> None:
    """Non-UTF-8 bytes, 6,000-digit integers, 200,000 levels of nesting, NaN, truncation: each
    is one ChannelConfigError that names the file (was UnicodeDecodeError, CPython's digit-limit
    ValueError or RecursionError)."""
    path = tmp_path / "channels.json"
    path.write_bytes(content)
    with pytest.raises(ChannelConfigError, match=r"channel config '.*channels\.json'"):
        ChannelConfig.load(path, **_LOAD_KWARGS)


def test_a_file_over_the_size_bound_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "huge.json"
    with path.open("wb") as f:
        f.truncate(CHANNEL_CONFIG_MAX_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ChannelConfigError, match=f"larger than {CHANNEL_CONFIG_MAX_BYTES} bytes"):
        ChannelConfig.load(path, **_LOAD_KWARGS)


def _mutated(layer: int, head: int, row: object) -> dict[str, Any]:
    data = _file_data(2, 2)
    data[layer_key(layer, HeavyChannelType.K)][head] = row
    return data


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (
            _mutated(1, 0, [3, 16, 2, 1]),
            r"calib\.json.*layers\.1\..*head 0: channel 16 .*\[0, 16\)",
        ),
        (_mutated(0, 1, [-1, 2, 3, 4]), r"layers\.0\..*head 1: channel -1 .*out of range"),
        (_mutated(0, 1, [2, 3, 2, 4]), r"head 1: channel 2 repeats at rank 2"),
        (_mutated(1, 1, [2, 3, 4]), r"layers\.1\..*head 1: 3 channels listed; .*at least 4"),
        (_mutated(0, 0, [2, 3.0, 4, 5]), r"head 0: entry 1 is 3\.0; .*ints"),
        (_mutated(0, 0, [True, 3, 4, 5]), r"head 0: entry 0 is True"),
        (_mutated(0, 0, "0123"), r"head 0: row is a 'str'"),
        (
            {
                "model.layers.0.self_attn.k_proj": _file_data(1, 2)[
                    "model.layers.0.self_attn.k_proj"
                ]
            },
            r"layer key 'model\.layers\.1\.self_attn\.k_proj' is missing",
        ),
        (
            {**_file_data(2, 2), "model.layers.1.self_attn.k_proj": [_ranking(1)] * 3},
            r"has 3 rows; .*2 or 4 rows",
        ),
        ([1, 2, 3], r"top level is 'list'"),
    ],
)
def test_malformed_file_is_rejected_naming_file_layer_head_and_value(
    data: object, pattern: str
) -> None:
    """Each malformed entry raises ChannelConfigError with the file, key, head and bad value."""
    with pytest.raises(ChannelConfigError, match=pattern) as info:
        _load(data)
    assert "calib.json" in str(info.value)


def test_missing_key_of_the_other_type_is_reported() -> None:
    """A file with only k_proj keys fails for type qk and shows the keys it has."""
    with pytest.raises(ChannelConfigError, match=r"qk_proj' is missing.*k_proj"):
        _load(_file_data(2, 2), config=DSConfig(heavy_channel_num=4))


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"config": DSConfig(heavy_channel_num=17)}, r"heavy_channel_num=17 .*head_dim=16"),
        ({"num_q_heads": 3}, r"num_q_heads=3 must be a multiple of num_kv_heads=2"),
        ({"layers": []}, "layers is empty"),
        ({"head_dim": 0}, r"head_dim=0"),
    ],
)
def test_inconsistent_geometry_is_rejected(overrides: dict[str, Any], pattern: str) -> None:
    """Geometry that cannot hold the requested channels is rejected before the file is read."""
    with pytest.raises(DSConfigError, match=pattern):
        _load(_file_data(2, 2), **overrides)


def test_unknown_layer_lookup_lists_the_loaded_layers() -> None:
    """layer_channels of a layer not loaded names the loaded ones."""
    with pytest.raises(DSConfigError, match=r"layer=5 .*\(0, 1\)"):
        _load(_file_data(2, 2)).layer_channels(5)


@given(
    group=st.integers(1, 8),
    count=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_group_reduction_returns_distinct_channels_from_the_heads_tops(
    group: int, count: int, seed: int
) -> None:
    """The merged channels are distinct, ``count`` many, each among some head's first ``count``."""
    rows = [_ranking(seed + h, 16) for h in range(group)]
    merged = reduce_group_channels(rows, count)
    assert len(merged) == count == len(set(merged))
    tops = {ch for row in rows for ch in row[:count]}
    assert set(merged) <= tops
    assert reduce_group_channels([rows[0]] * group, count) == rows[0][:count]


def test_a_tp_rank_takes_the_channels_of_its_own_kv_heads() -> None:
    """Runs of heads when they split over the ranks, one replicated head when they do not."""
    cfg = _load(_file_data(2, 4), num_kv_heads=4, num_q_heads=8)
    assert cfg.for_tp_rank(1, 0) is cfg
    for rank in range(2):  # two heads each
        assert torch.equal(
            cfg.for_tp_rank(2, rank).channels, cfg.channels[:, 2 * rank : 2 * rank + 2]
        )
    for rank in range(8):  # each head on two consecutive ranks
        got = cfg.for_tp_rank(8, rank).channels
        assert torch.equal(got, cfg.channels[:, rank // 2 : rank // 2 + 1])
    assert cfg.for_tp_rank(2, 1).layers == cfg.layers


@pytest.mark.parametrize(
    ("tp_size", "tp_rank", "match"),
    [
        (3, 0, r"tp_size=3 does not split 4 K/V heads.*allowed: a divisor \[1, 2, 4\]"),
        (6, 0, r"tp_size=6 does not split 4 K/V heads"),
        (2, 2, r"tp_rank=2 is not allowed; allowed: 0 to 1"),
        (0, 0, r"tp_size=0 is not allowed"),
    ],
)
def test_a_tp_layout_that_does_not_split_the_heads_is_refused_by_name(
    tp_size: int, tp_rank: int, match: str
) -> None:
    cfg = _load(_file_data(2, 4), num_kv_heads=4, num_q_heads=8)
    with pytest.raises(DSConfigError, match=match):
        cfg.for_tp_rank(tp_size, tp_rank)
