"""``qsa-hisparse calibrate``: write a double-sparsity channel file from a model and a text set.

Runs a Hugging Face decoder (Llama, Qwen2/3, Mistral) over a few sequences of a text file (or of
token ids), ranks every head's query or key channels (:func:`qsa_kernels.double_sparsity.
calibrate_channels`) and writes the JSON that :class:`qsa_kernels.double_sparsity.ChannelConfig`
loads. Every argument is checked before the model loads, and all but the CUDA device's presence
before torch is imported: the model's ``config.json``, token ids against its vocabulary, the seed,
the device's spelling, the output path. The model loads on CPU in float32 unless told otherwise.
Needs the ``calibrate`` extra (transformers, tqdm).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from qsa_core import (
    CONFIG_JSON_MAX_BYTES,
    JSONFileError,
    PromptError,
    check_prompt,
    read_json_file,
)

_DTYPES = ("float32", "bfloat16", "float16")

#: Most bytes of a ``--token-ids`` file (64 sequences of 1,024 ids take about 0.5 MiB).
TOKEN_IDS_MAX_BYTES = 256 << 20

#: ``torch.manual_seed`` takes seeds in [0, 2**64).
_MAX_SEED = 2**64 - 1

_DEVICE = re.compile(r"cpu|cuda(?::\d{1,4})?")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsa-hisparse calibrate",
        description=(
            "Rank each attention head's channels over a small text set and write the heavy-"
            "channel file double sparsity loads."
        ),
    )
    parser.add_argument("model", type=pathlib.Path, help="a Hugging Face model directory")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the JSON file to write")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--text", type=pathlib.Path, help="a UTF-8 text file (the model's tokenizer)"
    )
    source.add_argument(
        "--token-ids", type=pathlib.Path, help="a JSON list of token-id lists (no tokenizer needed)"
    )
    parser.add_argument("--channel-type", choices=("q", "k", "qk"), default="qk")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--max-sequences", type=int, default=64, help="sequences at most")
    parser.add_argument("--device", default="cpu", help="torch device for the model")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32")
    parser.add_argument(
        "--random-weights",
        type=int,
        metavar="SEED",
        help="initialise the weights from the config with this seed instead of loading them",
    )
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Every check that needs no torch and no model; returns the model's config.

    Exits with status 2 (``parser.error``) naming the flag, the value and what is allowed.
    """
    try:
        config = read_json_file(
            args.model / "config.json", what="model config", max_bytes=CONFIG_JSON_MAX_BYTES
        )
    except JSONFileError as exc:
        parser.error(f"{exc}; give a Hugging Face model directory")
    if not isinstance(config, dict):
        parser.error(f"model {str(args.model)!r}: config.json holds no JSON object")
    for flag, path in (("--text", args.text), ("--token-ids", args.token_ids)):
        if path is not None and not path.is_file():
            parser.error(f"{flag} {str(path)!r} is not a readable file")
    for flag, value in (("--seq-len", args.seq_len), ("--max-sequences", args.max_sequences)):
        if value < 1:
            parser.error(f"{flag} {value!r} is not allowed; allowed: a positive integer")
    seed = args.random_weights
    if seed is not None and not 0 <= seed <= _MAX_SEED:
        parser.error(f"--random-weights {seed!r} is not allowed; allowed: 0 to {_MAX_SEED}")
    if not _DEVICE.fullmatch(args.device):
        parser.error(f"--device {args.device!r} is not allowed; allowed: cpu, cuda, cuda:N")
    if args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} is a directory; give the path of the file to write")
    parent = args.out.resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        parser.error(f"--out {str(args.out)!r}: directory {str(parent)!r} is not writable")
    return config


def _vocab_size(config: dict[str, Any]) -> int | None:
    """The model's vocabulary size from its config (or its ``text_config``), if it names one."""
    text = config.get("text_config")
    for source in (config, text if isinstance(text, dict) else {}):
        size = source.get("vocab_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


def _token_id_sequences(
    args: argparse.Namespace, parser: argparse.ArgumentParser, config: dict[str, Any]
) -> list[list[int]]:
    """The ``--token-ids`` sequences, each a prompt the model can run (:func:`check_prompt`)."""
    try:
        data = read_json_file(args.token_ids, what="--token-ids", max_bytes=TOKEN_IDS_MAX_BYTES)
    except JSONFileError as exc:
        parser.error(str(exc))
    if not isinstance(data, list) or not data:
        parser.error(
            f"--token-ids {str(args.token_ids)!r}: expected a non-empty JSON list of "
            "non-empty lists of token ids"
        )
    vocab = _vocab_size(config)
    if vocab is None:
        parser.error(f"model {str(args.model)!r}: config.json names no vocab_size")
    sequences = []
    for i, seq in enumerate(data[: args.max_sequences]):
        named = f"--token-ids {str(args.token_ids)!r}, sequence {i}"
        if not isinstance(seq, list):
            parser.error(f"{named} is a {type(seq).__name__}; allowed: a list of token ids")
        try:
            check_prompt(seq[: args.seq_len], vocab)
        except PromptError as exc:
            parser.error(f"{named}: {exc}")
        sequences.append(seq[: args.seq_len])
    return sequences


def _text_sequences(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[list[int]]:
    from transformers import AutoTokenizer

    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--text {str(args.text)!r} is not readable UTF-8 text: {exc}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids: list[int] = tokenizer(text)["input_ids"]
    if not ids:
        parser.error(f"--text {str(args.text)!r} holds no tokens")
    chunks = [ids[i : i + args.seq_len] for i in range(0, len(ids), args.seq_len)]
    return chunks[: args.max_sequences]


def _load_model(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(args.model)
    if args.random_weights is not None:
        torch.manual_seed(args.random_weights)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model.to(args.device).eval(), config


def _check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Refuse a CUDA device this machine lacks, before the model loads (:func:`_check` spells)."""
    import torch

    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            allowed = "cpu" if count == 0 else f"cpu, cuda, cuda:0 to cuda:{count - 1}"
            parser.error(
                f"--device {device!r}: this machine has {count} CUDA devices; allowed: {allowed}"
            )


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it: whole or not at all.

    The temporary file is removed when anything fails, the final rename included.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Run the calibration; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    config = _check(parser, args)
    given = None if args.token_ids is None else _token_id_sequences(args, parser, config)
    _check_device(parser, args.device)
    sequences = _text_sequences(args, parser) if given is None else given
    import torch
    from tqdm import tqdm  # type: ignore[import-untyped]

    from qsa_kernels.double_sparsity import calibrate_channels

    model, config = _load_model(args)
    q_heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or q_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // q_heads)
    total = sum(len(seq) for seq in sequences)
    with tqdm(total=total, unit="tok", desc="calibrating", file=sys.stderr) as bar:
        channels = calibrate_channels(
            model,
            (torch.tensor(seq, device=args.device) for seq in sequences),
            channel_type=args.channel_type,
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            on_batch=bar.update,
        )
    out = args.out.resolve()
    _write_atomically(out, json.dumps(channels, indent=1))
    rows = "KV head" if args.channel_type == "k" else "query head"
    sys.stdout.write(
        f"wrote {out}: {len(channels)} layers, one ranking of {head_dim} channels per {rows} "
        f"({kv_heads} KV heads, {q_heads} query heads), {args.channel_type!r} over "
        f"{total} tokens in {len(sequences)} sequences\n"
    )
    return 0
