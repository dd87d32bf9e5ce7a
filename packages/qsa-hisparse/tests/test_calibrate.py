"""``qsa-hisparse calibrate`` on the tiny Llama: a channel file double sparsity loads as is."""

from __future__ import annotations

import json
import pathlib

import pytest

from qsa_hisparse import main
from qsa_kernels.double_sparsity import ChannelConfig, DSConfig, HeavyChannelType, layer_key
from qsa_testing import tiny_llama

LLAMA = tiny_llama()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return LLAMA.write(tmp_path_factory.mktemp("llama"))


def _token_ids(path: pathlib.Path) -> pathlib.Path:
    path.write_text(json.dumps([list(LLAMA.prompt(40, seed=s)) for s in range(3)]))
    return path


def test_calibrating_the_tiny_llama_writes_a_loadable_gqa_channel_file(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "channels.json"
    argv = [str(model_dir), "--out", str(out), "--token-ids", str(_token_ids(tmp_path / "t.json"))]
    assert main(["calibrate", *argv, "--random-weights", "0"]) == 0
    text = LLAMA.config
    fields = ("num_attention_heads", "num_key_value_heads", "head_dim")
    heads, kv_heads, dim = (int(text[k]) for k in fields)
    data = json.loads(out.read_text())
    layers = range(int(text["num_hidden_layers"]))
    assert sorted(data) == sorted(layer_key(i, HeavyChannelType.QK) for i in layers)
    assert all(len(rows) == heads for rows in data.values())  # one ranking per query head
    loaded = ChannelConfig.load(
        out,
        config=DSConfig(heavy_channel_num=4, heavy_token_num=16),
        layers=layers,
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
    )
    assert loaded.channels.shape == (len(layers), kv_heads, 4)
    assert "120 tokens in 3 sequences" in capsys.readouterr().out


def test_the_same_seed_and_tokens_give_the_same_file(
    model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    ids = _token_ids(tmp_path / "t.json")
    files = []
    for name in ("a.json", "b.json"):
        out = tmp_path / name
        argv = [str(model_dir), "--out", str(out), "--token-ids", str(ids), "--channel-type", "k"]
        assert main(["calibrate", *argv, "--random-weights", "7"]) == 0
        files.append(out.read_text())
    assert files[0] == files[1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seq-len", "0"], "--seq-len 0 is not allowed"),
        (["--channel-type", "v"], "invalid choice: 'v'"),
        (["--text", "/nonexistent.txt"], "is not a readable file"),
        (["--device", "tpu:9"], "--device 'tpu:9' is not a torch device"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_model_loads(
    model_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    out = tmp_path / "never.json"
    source = [] if "--text" in extra else ["--token-ids", str(_token_ids(tmp_path / "t.json"))]
    with pytest.raises(SystemExit) as excinfo:
        main(["calibrate", str(model_dir), "--out", str(out), *source, *extra])
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
