"""SGLang's own serving client (``python -m sglang.benchmark.serving``) against a running server.

Tests and the serving benchmark drive servers the way operators measure them: with SGLang's
client, over HTTP, the prompts given as token ids (``--tokenize-prompt``). The client draws ids
below its tokenizer's ``vocab_size``, so it reads a word-level tokenizer of exactly the model's
vocabulary (:func:`word_level_tokenizer`); the server keeps the model's own tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qsa_testing._errors import EngineRequestError

__all__ = (
    "ClientReport",
    "random_ids_flags",
    "run_serving_client",
    "shared_prefix_flags",
    "word_level_tokenizer",
)


@dataclass(frozen=True, slots=True)
class ClientReport:
    """What the client measured over its run (its ``--output-file`` line), in its own units.

    Attributes:
        completed: requests answered in full.
        total_input_tokens: prompt tokens sent.
        total_output_tokens: tokens streamed back.
        duration: wall time of the run, in seconds.
        request_throughput: completed requests per second.
        input_throughput: prompt tokens per second.
        output_throughput: streamed tokens per second.
        mean_ttft_ms: time to the first token, mean (ms).
        p99_ttft_ms: time to the first token, 99th percentile (ms).
        mean_tpot_ms: time per output token after the first, mean over requests (ms).
        p99_tpot_ms: the same, 99th percentile (ms).
        mean_itl_ms: gap between streamed tokens, mean (ms).
        p99_itl_ms: the same, 99th percentile (ms).
    """

    completed: int
    total_input_tokens: int
    total_output_tokens: int
    duration: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    p99_itl_ms: float

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> ClientReport:
        """The report of one ``--output-file`` line, each field converted to its declared type.

        Raises:
            KeyError: naming a field the line lacks.
        """
        convert = {"int": int, "float": float}  # the annotations, as strings
        values: dict[str, Any] = {
            f.name: convert[str(f.type)](reply[f.name]) for f in dataclasses.fields(cls)
        }
        return cls(**values)


def word_level_tokenizer(directory: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """Write a word-level tokenizer of exactly ``vocab_size`` ids (``t0`` ...); returns its folder.

    For the client only: it makes the client's random ids those the model accepts.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (directory / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = {"tokenizer_class": "TokenizersBackend", "model_max_length": 1 << 24}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def random_ids_flags(
    prompts: int, *, input_len: int, range_ratio: float, output_len: int
) -> list[str]:
    """Prompts of random ids, ``input_len`` × [``range_ratio``, 1] tokens, no prefix repeats.

    Each request asks for ``output_len`` tokens with ``ignore_eos`` (the client's default).
    """
    return [
        "--dataset-name", "random-ids",
        "--num-prompts", str(prompts),
        "--random-input-len", str(input_len),
        "--random-range-ratio", str(range_ratio),
        "--random-output-len", str(output_len),
    ]  # fmt: skip


def shared_prefix_flags(
    prompts: int, *, prefix_len: int, question_len: int, output_len: int
) -> list[str]:
    """One system prompt of ``prefix_len`` tokens before each request's ``question_len`` tokens.

    Each request asks for ``output_len`` tokens with ``ignore_eos`` (the client's default), as
    operators' runs of the client do; the plugin loads such a request's host hit like any other.
    """
    return [
        "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", "1",
        "--gsp-prompts-per-group", str(prompts),
        "--gsp-system-prompt-len", str(prefix_len),
        "--gsp-question-len", str(question_len),
        "--gsp-output-len", str(output_len),
        "--gsp-range-ratio", "1.0",
    ]  # fmt: skip


def run_serving_client(
    address: str,
    dataset: Sequence[str],
    *,
    tokenizer: pathlib.Path,
    max_concurrency: int,
    seed: int,
    flush_cache: bool,
    report: pathlib.Path,
) -> ClientReport:
    """Run the client once against the server at ``address``; what it measured.

    Args:
        address: the server's base URL (``http://host:port``).
        dataset: the dataset's flags (:func:`random_ids_flags`, :func:`shared_prefix_flags`).
        tokenizer: the client's tokenizer folder (:func:`word_level_tokenizer`).
        max_concurrency: requests in flight at most.
        seed: the client's random seed (prompts and their order).
        flush_cache: flush the server's caches before the run (``/flush_cache``, when idle).
        report: the client's output file; its last line is this run's.

    Raises:
        EngineRequestError: the client failed (the message has its stderr's tail).
    """
    command = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--backend", "sglang",
        "--base-url", address,
        *dataset,
        "--tokenize-prompt",
        "--tokenizer", str(tokenizer),
        "--max-concurrency", str(max_concurrency),
        "--warmup-requests", "0",
        "--seed", str(seed),
        *(["--flush-cache"] if flush_cache else []),
        "--disable-tqdm",
        "--output-file", str(report),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        msg = f"SGLang's client exited {done.returncode}; its stderr ends: {done.stderr[-3000:]}"
        raise EngineRequestError(msg)
    reply = json.loads(report.read_text(encoding="utf-8").splitlines()[-1])
    return ClientReport.from_reply(reply)
