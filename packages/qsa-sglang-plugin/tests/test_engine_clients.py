"""A real client against a real server with the plugin, as an operator's users reach it.

SGLang's OpenAI-compatible API is driven through the ``openai`` package: streams that hang up
at once or half-way, prompts the model cannot serve sent while they run, then an ordinary
request. The server must answer the bad prompts 400 and keep serving, answer the ordinary request
as it did before the storm, and hold nothing afterwards: no lease, no host-arena row, no checkpoint
being written, no checkpoint pinned (its Prometheus endpoint shows each). The same prompt check
guards the resident path (``p2-resident``), which the offload tests do not start.

The engines serve the tiny Qwen4Exp with its tokenizer (the vision variant): the OpenAI routes
answer text, which SGLang cannot make with ``skip_tokenizer_init``.
"""

from __future__ import annotations

import dataclasses
import enum
import pathlib
import threading
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from qsa_pytest.processes import hang_guard_s, wait_until
from qsa_testing import (
    BF16_LOGIT_STEP,
    Engine,
    EngineConfig,
    EnginePool,
    EngineRequestError,
    GenerateRequest,
    Platform,
    assert_same_generation,
    current_platform,
    run_serving_client,
    shared_prefix_flags,
    tiny_qwen4_exp,
    word_level_tokenizer,
)
from qsa_testing.demo import DEMO_ENGINE

QWEN = tiny_qwen4_exp(vision=True)
COMPAT = {"SGLANG_QSA_MODEL_COMPAT": "1"}
#: Offload with the host prefix cache, every part that holds something per request: the serving
#: configuration the demo shows operators, on the model with a tokenizer.
SERVED = dataclasses.replace(DEMO_ENGINE, model=QWEN)
#: The resident QSA path: upstream's kernels, the plugin's lifecycle and prompt check.
RESIDENT = EngineConfig(
    QWEN,
    switches={**COMPAT, "SGLANG_QSA_HISPARSE_V3": "p2-resident"},
    server_args={
        "radix_cache_backend": "qsa_hisparse",
        "disable_overlap_schedule": True,
        "context_length": 8192,
        "chunked_prefill_size": 1024,
    },
)
#: What the plugin holds per request, each a gauge that must read 0 with nothing in flight.
HELD = (
    "qsa_hisparse_live_leases",
    "qsa_hisparse_offload_rows_in_use",
    "qsa_hisparse_prefix_cache_reserved_entries",
    "qsa_hisparse_prefix_cache_pinned_entries",
)
#: Prompts the model cannot serve, as an OpenAI client sends them, and what the 400 must say.
UNSERVABLE: tuple[tuple[Any, str], ...] = (
    ("", "cannot be empty"),
    ([], "cannot be empty"),
    ([5, -1, 7], "prompt token 1 has id -1"),
    ([QWEN.vocab_size, 5], f"prompt token 0 has id {QWEN.vocab_size}"),
)
#: The ordinary request, answered before and after the storm (the second time from its checkpoint:
#: bit for bit on the CPU, within one bf16 step of a logit on CUDA).
ORDINARY = GenerateRequest(QWEN.prompt(1200, seed=7), max_new_tokens=8)
RERUN_NOISE = 0.0 if current_platform() is Platform.CPU else BF16_LOGIT_STEP


class Hangup(enum.Enum):
    """When a streaming client closes its connection."""

    NEVER = "reads to the end"
    AT_ONCE = "closes as soon as the response starts"
    MIDWAY = "closes after three chunks"


@dataclass
class _Stream:
    """One streamed completion on a thread, and what its client saw."""

    prompt: list[int]
    hangup: Hangup
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: BaseException | None = None


def _client(engine: Engine) -> Any:
    return openai.OpenAI(
        base_url=f"{engine.address}/v1", api_key="unused", max_retries=0, timeout=hang_guard_s()
    )


def _run(client: Any, model: str, stream: _Stream, max_tokens: int) -> None:
    try:
        reply = client.completions.create(
            model=model,
            prompt=stream.prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        if stream.hangup is Hangup.AT_ONCE:
            reply.close()
            return
        for chunk in reply:
            stream.chunks += 1
            if chunk.usage is not None:  # the last chunk; a chunk may carry several tokens
                stream.completion_tokens = chunk.usage.completion_tokens
            if chunk.choices:
                stream.finish_reason = chunk.choices[0].finish_reason or stream.finish_reason
            if stream.hangup is Hangup.MIDWAY and stream.chunks == 3:
                reply.close()
                return
    except BaseException as exc:
        stream.error = exc


def _held(engine: Engine) -> dict[str, float]:
    return {name: engine.metric(name) for name in HELD}


def _released(engine: Engine) -> float:
    """Leases given back, read once none is live (the outcome is counted before the gauge drops;
    a reply can reach the client before SGLang releases its row)."""
    wait_until(
        "every lease to come back",
        lambda: engine.metric("qsa_hisparse_live_leases") == 0,
        poll_s=0.01,
    )
    return engine.metric("qsa_hisparse_leases_released_total")


def _refused(client: Any, model: str, prompt: Any) -> str:
    """The message of the 400 that ``prompt`` must get."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=prompt, max_tokens=2)
    return str(refused.value)


@pytest.mark.engine(SERVED)
def test_streams_that_hang_up_and_bad_prompts_leave_nothing_held_and_answers_unchanged(
    engines: EnginePool,
) -> None:
    """Eight streams of 1,500 to 2,900-token prompts (prefilled in chunks, checkpointed), two of
    them closed as soon as they start and four after three tokens, while the unservable prompts
    arrive: each bad prompt gets its 400, every stream that read to the end got all its tokens,
    every request gave its lease back as finished or aborted, and the ordinary request answers
    exactly as before."""
    engine = engines.engine(SERVED)
    before = engine.generate(ORDINARY)
    released_before = _released(engine)
    client = _client(engine)
    model = client.models.list().data[0].id
    hangups = (Hangup.NEVER, Hangup.AT_ONCE, Hangup.MIDWAY, Hangup.MIDWAY)
    streams = [
        _Stream(list(QWEN.prompt(1500 + 700 * (i % 3), seed=100 + i)), hangups[i % 4])
        for i in range(8)
    ]
    threads = [
        threading.Thread(target=_run, args=(client, model, stream, 48), daemon=True)
        for stream in streams
    ]
    for thread in threads:
        thread.start()
    for prompt, named in UNSERVABLE:
        assert named in _refused(client, model, prompt)
    with pytest.raises(EngineRequestError, match="answered 400"):
        engine.post_json("/generate", {"text": "", "sampling_params": {"max_new_tokens": 2}})
    for thread in threads:
        thread.join(hang_guard_s())
        assert not thread.is_alive(), "a stream did not end"
    assert [s.error for s in streams] == [None] * len(streams)
    for stream in streams:
        if stream.hangup is Hangup.NEVER:
            assert (stream.completion_tokens, stream.finish_reason) == (48, "length"), stream

    wait_until("the plugin to hold nothing", lambda: not any(_held(engine).values()), poll_s=0.05)
    assert _released(engine) == released_before + len(streams)
    assert engine.metric("qsa_hisparse_leases_released_total", outcome="aborted") >= 1
    assert engine.running
    after = engine.generate(ORDINARY)
    assert_same_generation(before, after, atol=RERUN_NOISE, what="the ordinary request")
    assert not any(_held(engine).values()), _held(engine)


@pytest.mark.engine(SERVED)
def test_sglang_bench_client_loads_a_shared_prefix_for_every_request_after_the_first(
    engines: EnginePool, tmp_path: pathlib.Path
) -> None:
    """SGLang's own serving client sends four prompts that share a 1,024-token system prompt (one
    prefill chunk), two at a time, each asking for 8 tokens with ``ignore_eos`` (the client's
    default): the first computes and checkpoints the shared prefix, each later one loads it from
    the host cache and computes only its own 64 tokens, every request gets its 8 tokens, and
    nothing is held once the run ends."""
    engine = engines.engine(SERVED)
    prompts, prefix, question, output = 4, 1024, 64, 8
    loads = "qsa_hisparse_prefix_cache_loads_total"
    loaded = "qsa_hisparse_prefix_cache_loaded_tokens_total"
    before = (engine.metric(loads), engine.metric(loaded))
    measured = run_serving_client(
        engine.address,
        shared_prefix_flags(prompts, prefix_len=prefix, question_len=question, output_len=output),
        tokenizer=word_level_tokenizer(tmp_path / "tokenizer", QWEN.vocab_size),
        max_concurrency=2,
        seed=5,
        flush_cache=True,
        report=tmp_path / "report.jsonl",
    )
    assert (measured.completed, measured.total_input_tokens, measured.total_output_tokens) == (
        prompts,
        prompts * (prefix + question),
        prompts * output,
    )
    gained = (int(engine.metric(loads) - before[0]), int(engine.metric(loaded) - before[1]))
    assert gained == (prompts - 1, (prompts - 1) * prefix)
    wait_until("the plugin to hold nothing", lambda: not any(_held(engine).values()), poll_s=0.05)


@pytest.mark.engine(SERVED)
def test_ignore_eos_requests_load_their_checkpoint_and_answer_as_computed(
    engines: EnginePool,
) -> None:
    """SGLang's clients send ``ignore_eos``; with the radix cache disabled SGLang would admit such
    a request on a path that never loads a host hit. It loads its checkpoint as any other does,
    and generates exactly its ``max_new_tokens`` tokens as the same request computed whole."""
    engine = engines.engine(SERVED)
    prompt = QWEN.prompt(1100, seed=61)  # checkpointed at 1,024 tokens by its first serve
    loads = "qsa_hisparse_prefix_cache_loads_total"
    cold = engine.generate(GenerateRequest(prompt, 16, ignore_eos=True, cache_salt="cold"))
    before = engine.metric(loads)
    warm = [engine.generate(GenerateRequest(prompt, 16, ignore_eos=True)) for _ in range(2)]
    assert cold.cached_tokens == 0
    assert [w.cached_tokens for w in warm] == [0, 1024]
    assert engine.metric(loads) - before == 1
    assert len(warm[1].output_ids) == 16
    assert_same_generation(cold, warm[1], atol=RERUN_NOISE, what="an ignore_eos request warm")
    wait_until("the plugin to hold nothing", lambda: not any(_held(engine).values()), poll_s=0.05)


@pytest.mark.engine(RESIDENT)
@pytest.mark.parametrize(("prompt", "named"), UNSERVABLE)
def test_the_resident_path_answers_an_unservable_prompt_400_and_serves_on(
    engines: EnginePool, prompt: Any, named: str
) -> None:
    engine = engines.engine(RESIDENT)
    client = _client(engine)
    assert named in _refused(client, client.models.list().data[0].id, prompt)
    assert engine.running
    assert len(engine.generate(GenerateRequest(QWEN.prompt(40, seed=41), 2)).output_ids) == 2
