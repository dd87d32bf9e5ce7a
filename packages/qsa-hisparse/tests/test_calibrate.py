"""``qsa-hisparse calibrate`` on the tiny Llama: a channel file double sparsity loads as is."""

from __future__ import annotations

import json
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings

from qsa_hisparse import main
from qsa_kernels.double_sparsity import ChannelConfig, DSConfig, HeavyChannelType, layer_key
from qsa_pytest.refusals import malformed_json, refusal_in_fresh_interpreter
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
        (["--device", "tpu:9"], "--device 'tpu:9' is not allowed; allowed: cpu, cuda, cuda:N"),
        (["--device", "meta"], "--device 'meta' is not allowed"),
        (["--random-weights", "-1"], "--random-weights -1 is not allowed; allowed: 0 to 1844"),
        (["--random-weights", str(2**64)], f"--random-weights {2**64} is not allowed"),
        (["--out-dir"], "is a directory; give the path of the file to write"),
        (["--ids", "[[1, 2, 1000000]]"], "sequence 0: prompt token 2 has id 1000000"),
        (["--ids", "[[1], [-3]]"], "sequence 1: prompt token 0 has id -3"),
        (["--ids", "[[1], []]"], "sequence 1: the prompt has 0 tokens"),
        (["--ids", '[[1], {"a": 1}]'], "sequence 1 is a dict; allowed: a list of token ids"),
        (["--ids", "[[1, 2.5]]"], "prompt token 1 is 2.5 (float)"),
        (["--ids", "[]"], "expected a non-empty JSON list"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_torch_or_the_model_loads(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, extra: list[str], message: str
) -> None:
    """Token ids past the vocabulary, the seed and the device were checked only after the model
    had loaded (or by torch's own error), and ``--out`` a directory left a ``*.tmp`` file."""
    out = tmp_path / "never.json"
    ids = _token_ids(tmp_path / "t.json")
    if extra[0] == "--ids":
        ids.write_text(extra[1])
        extra = []
    elif extra == ["--out-dir"]:
        out, extra = tmp_path / "a-directory", []
        out.mkdir()
    source = [] if "--text" in extra else ["--token-ids", str(ids)]
    ended = refusal_in_fresh_interpreter(
        "qsa_hisparse",
        ["calibrate", str(model_dir), "--out", str(out), *source, *extra],
        watched=("torch", "transformers"),
    )
    assert ended.returncode == 2, ended.stderr
    assert message in ended.stderr, ended.stderr
    assert ended.imported == frozenset(), "imported before the refusal"
    assert not out.is_file()
    assert list(tmp_path.glob("*.tmp")) == list(tmp_path.glob(".*.tmp")) == []


def test_a_cuda_device_this_machine_lacks_is_refused_before_the_model_loads(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = tmp_path / "never.json"
    argv = [str(model_dir), "--out", str(out), "--token-ids", str(_token_ids(tmp_path / "t.json"))]
    with pytest.raises(SystemExit) as exited:
        main(["calibrate", *argv, "--device", f"cuda:{count}"])
    assert exited.value.code == 2
    assert f"--device 'cuda:{count}': this machine has {count} CUDA devices" in (
        capsys.readouterr().err
    )


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=malformed_json())
def test_a_malformed_token_id_file_is_refused_naming_it(
    model_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    content: bytes,
) -> None:
    ids = tmp_path / "ids.json"
    ids.write_bytes(content)
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "calibrate",
                str(model_dir),
                "--out",
                str(tmp_path / "o.json"),
                "--token-ids",
                str(ids),
            ]
        )
    assert exited.value.code == 2
    assert f"error: --token-ids {str(ids)!r}" in capsys.readouterr().err


def test_a_failed_write_leaves_no_temporary_file(tmp_path: pathlib.Path) -> None:
    from qsa_hisparse._calibrate import _write_atomically

    target = tmp_path / "taken"
    target.mkdir()
    (target / "child").write_text("keeps the directory non-empty")
    with pytest.raises(IsADirectoryError):  # os.replace onto a directory
        _write_atomically(target, "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
