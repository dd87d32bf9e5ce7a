"""``qsa-hisparse calibrate``: write a double-sparsity channel file from a model and a text set.

Runs a Hugging Face decoder (Llama, Qwen2/3, Mistral) over a few sequences of a text file (or of
token ids), ranks every head's query or key channels (:func:`qsa_kernels.double_sparsity.
calibrate_channels`) and writes the JSON that :class:`qsa_kernels.double_sparsity.ChannelConfig`
loads. Arguments are checked before torch or the model loads; the model loads on CPU in float32
unless told otherwise. Needs the ``calibrate`` extra (transformers, tqdm).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")


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


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.model / "config.json").is_file():
        parser.error(f"model {str(args.model)!r} has no config.json; give a model directory")
    for flag, path in (("--text", args.text), ("--token-ids", args.token_ids)):
        if path is not None and not path.is_file():
            parser.error(f"{flag} {str(path)!r} is not a readable file")
    for flag, value in (("--seq-len", args.seq_len), ("--max-sequences", args.max_sequences)):
        if value < 1:
            parser.error(f"{flag} {value!r} is not allowed; allowed: a positive integer")
    parent = args.out.resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        parser.error(f"--out {str(args.out)!r}: directory {str(parent)!r} is not writable")


def _sequences(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[list[int]]:
    if args.token_ids is not None:
        try:
            data = json.loads(args.token_ids.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            parser.error(f"--token-ids {str(args.token_ids)!r} is not JSON: {exc}")
        ok = isinstance(data, list) and all(
            isinstance(seq, list) and seq and all(isinstance(t, int) and t >= 0 for t in seq)
            for seq in data
        )
        if not ok or not data:
            parser.error(
                f"--token-ids {str(args.token_ids)!r}: expected a non-empty JSON list of "
                "non-empty lists of non-negative ints"
            )
        return [seq[: args.seq_len] for seq in data[: args.max_sequences]]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids: list[int] = tokenizer(args.text.read_text(encoding="utf-8"))["input_ids"]
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
    """Refuse a device torch cannot name or this machine lacks, before the model loads."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        parser.error(f"--device {device!r} is not a torch device; allowed: cpu, cuda, cuda:N")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device!r}: this machine has no CUDA device; allowed: cpu")


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it: whole or not at all."""
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, suffix=".tmp", delete=False
    ) as tmp:
        try:
            tmp.write(text)
        except BaseException:
            tmp.close()
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the calibration; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    sequences = _sequences(args, parser)
    import torch
    from tqdm import tqdm  # type: ignore[import-untyped]

    _check_device(parser, args.device)

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
