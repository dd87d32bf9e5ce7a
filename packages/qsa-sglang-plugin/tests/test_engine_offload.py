"""Offload in a real SGLang 0.5.23 engine with ``SGLANG_QSA_HISPARSE_V3=p2-offload``.

Every decode step of the QSA layer reads its K/V from the host arena, the hot cache and the
open-block tail (the offload backend), never from SGLang's KV pool; what the engine answers must
still be upstream's tokens, with logprobs within bf16 noise. The ``qsa_hisparse`` radix-cache
backend holds one lease (one arena row) per request that has a KV row and gives every lease back,
whatever ends the request: it finishes, it is aborted while it decodes or while its prompt is
still being prefilled in chunks, or SGLang retracts it. The engine's Prometheus endpoint shows it.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from qsa_pytest.processes import wait_until
from qsa_testing import (
    BF16_LOGIT_STEP,
    Engine,
    EngineConfig,
    EnginePool,
    EngineRequestError,
    EngineStartError,
    GenerateRequest,
    Generation,
    Platform,
    SelectionTrace,
    assert_same_generation,
    cuda_graphs_requested,
    current_platform,
    routing_differences,
    start_engine,
    tiny_image,
    tiny_qwen4_exp,
)

QWEN = tiny_qwen4_exp()
OFFLOAD_SWITCHES = {"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_HISPARSE_V3": "p2-offload"}
#: The same, with every released row's host bytes compared with a resident copy of its K/V.
VERIFIED_SWITCHES = {**OFFLOAD_SWITCHES, "SGLANG_QSA_HISPARSE_VERIFY": "1"}
#: CUDA graphs follow the session (``QSA_TESTING_CUDA_GRAPHS``), as upstream's do: on the H200 both
#: arms run eagerly and then both with SGLang's default graphs (decode graphs, and breakable
#: prefill graphs whose attention runs eagerly over the real batch).
OFFLOAD_ARGS = {
    "radix_cache_backend": "qsa_hisparse",
    "disable_overlap_schedule": True,
    "enable_metrics": True,
    "max_running_requests": 4,
    "prefill_max_requests": 1,
    "context_length": 8192,
}
#: SGLang's overlap scheduling (its default), which the offload and the host prefix cache serve:
#: batch ``N + 1`` is planned and launched before batch ``N``'s result is processed, so a prompt
#: moves to the host (and its end is checkpointed) before SGLang's checkpoint call, and a
#: finished request's row is released after the next step has been planned with it.
OVERLAPPED = {"disable_overlap_schedule": False}
#: Whether the engines decode eagerly (every CPU engine; CUDA ones without decode graphs), so
#: that the QSA indexer's selections are traced step by step (``EngineConfig.trace_selection``).
EAGER = current_platform() is Platform.CPU or not cuda_graphs_requested()
#: Two prompts staged at once: a prefill batch holds up to two requests.
#: SGLang reports the experts each MoE layer routed a token to (``return_routed_experts``): the
#: engines compared with upstream report them, so a comparison can tell a router's near-tie from a
#: wrong read (:func:`routing_differences`).
ROUTED_EXPERTS = {"enable_return_routed_experts": True}
LIFECYCLE = EngineConfig(
    QWEN,
    switches=VERIFIED_SWITCHES,
    server_args={
        **OFFLOAD_ARGS,
        **ROUTED_EXPERTS,
        **OVERLAPPED,
        "chunked_prefill_size": 1024,
        "prefill_max_requests": 2,
    },
    trace_selection=True,
)
#: So few KV slots that three concurrent 400 + 500-token requests cannot all decode: SGLang
#: retracts one and prefills it again later.
RETRACTING = EngineConfig(
    QWEN,
    switches=VERIFIED_SWITCHES,
    server_args={**OFFLOAD_ARGS, **OVERLAPPED, "context_length": 1024, "max_total_tokens": 1536},
)
#: Pools sized by SGLang from its memory budget (no --max-total-tokens), as an operator runs them.
#: SGLang's budget is the free memory after the weights load less ``1 - fraction`` of the free
#: memory before: about 0.9 GB here, and whatever else the machine runs moves it by as much, so
#: engines are compared per byte of their own budget (:class:`SizedPools`).
MEM_FRACTION_STATIC = 0.05
SIZED_BY_MEMORY = {"max_total_tokens": None, "mem_fraction_static": MEM_FRACTION_STATIC}


def _with_fixed_pools(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with the harness's fixed pools instead of :data:`SIZED_BY_MEMORY`."""
    return {k: v for k, v in args.items() if k not in SIZED_BY_MEMORY}


#: Upstream with the same prefill chunks as LIFECYCLE (chunking moves prefill logprobs on CUDA),
#: its pools sized from the memory budget: the capacity the offloaded engine is compared with.
UPSTREAM_SAME_CHUNKS = EngineConfig(
    QWEN,
    plugin=False,
    server_args={
        "chunked_prefill_size": 1024,
        "max_running_requests": 4,
        "context_length": 8192,
        **ROUTED_EXPERTS,
        **SIZED_BY_MEMORY,
    },
    trace_selection=True,
)
#: Prompts above 2,051 tokens (sparse selection), neither a multiple of 4 (open tails), one
#: below the chunk size; 64 greedy tokens cross 16 block boundaries.
SPARSE_PROMPTS = tuple(
    GenerateRequest(QWEN.prompt(tokens, seed=seed), max_new_tokens=64, routed_experts=True)
    for tokens, seed in ((2999, 1), (5001, 2), (301, 3))
)
#: The prompt the host prefix cache serves twice (checkpointed at its 1,024-token chunk ends).
REPEATED_PROMPT = GenerateRequest(QWEN.prompt(3000, seed=60), max_new_tokens=16)
#: Three requests that decode side by side (one decode batch of three rows).
CONCURRENT = tuple(
    GenerateRequest(QWEN.prompt(700 + s, seed=s), max_new_tokens=16, routed_experts=True)
    for s in (10, 11, 12)
)
#: Largest logprob difference allowed between the offloaded and the resident decode. The two
#: attend over the same tokens but split the softmax in two parts merged by their LSE; most steps
#: then differ by about 1e-4, and a step whose chosen logit rounds the other way differs by one
#: bf16 step of it (measured on the H200: 2^-7 and 2^-6, logits in [1, 4); on CPU at most 2.3e-5).
#: Where upstream's two best tokens lie one such step apart, the offload may tie them and choose
#: the other; the comparison ends at that step (``assert_same_generation``).
BF16_NOISE = BF16_LOGIT_STEP

_MAX_TOKENS = re.compile(r"max_total_num_tokens=(\d+)")
_FREE_BEFORE_WEIGHTS = re.compile(r"Load weight begin\. avail mem=([\d.]+) GB")
_FREE_AFTER_WEIGHTS = re.compile(r"Load weight end\..*?avail mem=([\d.]+) GB")


@dataclasses.dataclass(frozen=True, slots=True)
class SizedPools:
    """What SGLang sized an engine's pools to (:data:`SIZED_BY_MEMORY`), from its start-up log.

    Attributes:
        tokens: ``max_total_num_tokens``, the token capacity it chose.
        budget_gb: the budget it chose them for, in GB as SGLang logs them: the free memory once
            the weights loaded less ``1 - MEM_FRACTION_STATIC`` of the free memory before (each
            logged to 0.01 GB, so within about 0.01 GB).
    """

    tokens: int
    budget_gb: float

    @classmethod
    def of(cls, engine: Engine) -> SizedPools:
        log = engine.log_path.read_text(encoding="utf-8", errors="replace")
        found = [p.findall(log) for p in (_MAX_TOKENS, _FREE_BEFORE_WEIGHTS, _FREE_AFTER_WEIGHTS)]
        assert all(found), f"no pool sizing in {engine.log_path}"
        tokens, before, after = found
        budget = float(after[-1]) - (1 - MEM_FRACTION_STATIC) * float(before[-1])
        assert budget > 0, f"SGLang's budget {budget} GB in {engine.log_path}"
        return cls(int(tokens[-1]), budget)

    @property
    def tokens_per_gb(self) -> float:
        return self.tokens / self.budget_gb


@dataclasses.dataclass(frozen=True, slots=True)
class References:
    """What upstream answered to the text prompts (a module fixture of :data:`REFERENCES`, so
    taken before any other engine of the module starts).

    Attributes:
        text: :data:`UPSTREAM_SAME_CHUNKS`'s answers, by request.
        resident: the pools :data:`UPSTREAM_SAME_CHUNKS` sized from its budget.
        selections: the QSA indexer's decode selections of each answer (:data:`EAGER` only).
    """

    text: dict[GenerateRequest, Generation]
    resident: SizedPools
    selections: dict[GenerateRequest, SelectionTrace]


@pytest.fixture(scope="module")
def references(engines: EnginePool) -> References:
    requests = (*SPARSE_PROMPTS, *CONCURRENT, REPEATED_PROMPT)
    upstream = engines.engine(UPSTREAM_SAME_CHUNKS)
    text, selections = {}, {}
    for request in requests:
        text[request], trace = _traced(upstream, request)
        if trace is not None:
            selections[request] = trace
    return References(text, SizedPools.of(upstream), selections)


@pytest.fixture(scope="module")
def image_reference(engines: EnginePool) -> Generation:
    """The upstream vision engine's answer to :data:`IMAGE_REQUEST`."""
    return engines.generate(UPSTREAM_VL, IMAGE_REQUEST)


#: The module fixtures of reference answers, taken before the tests that use them (see
#: ``qsa_testing.pytest_plugin``).
REFERENCES = ("references", "image_reference")


def _traced(engine: Engine, request: GenerateRequest) -> tuple[Generation, SelectionTrace | None]:
    """``engine``'s answer to ``request`` and, when :data:`EAGER`, the selections it made."""
    before = engine.selection_trace() if EAGER else None
    answer = engine.generate(request)
    return answer, (engine.selection_trace(after=before) if before is not None else None)


def _other_selections(
    request: GenerateRequest, want: Generation, got: Generation, traces: tuple[SelectionTrace, ...]
) -> frozenset[int]:
    """The decode steps at which the two engines' QSA indexers chose different blocks.

    Step ``s`` (from 1; step 0 is the prefill's) is the forward of token ``s - 1`` at row length
    ``prompt + s``; steps after the first token that differs decode other contexts and are not
    compared. Without traces (decode graphs on), none are known.
    """
    if len(traces) != 2:
        return frozenset()
    upstream, offloaded = traces
    ids = zip(want.output_ids, got.output_ids, strict=False)
    last = next((s for s, (a, b) in enumerate(ids) if a != b), len(want.output_ids) - 1)
    prompt = len(request.input_ids)
    lengths = [prompt + step for step in range(1, last + 1)]
    return frozenset(d.length - prompt for d in upstream.differences(offloaded, lengths))


def _rerouted(want: Generation, got: Generation) -> frozenset[int]:
    """The steps at which some MoE layer routed the two answers to other experts."""
    return routing_differences(want, got, top_k=int(QWEN.text_config["num_experts_per_tok"]))


def _assert_as_upstream(
    want: Generation, got: Generation, what: str, *, other_blocks: frozenset[int] = frozenset()
) -> None:
    """``got`` answers as upstream's ``want`` within bf16 noise, but at the steps where a near-tie
    let the engines select ``other_blocks`` or route to other experts: at most one step in
    eight, whose tokens must still agree."""
    experts = _rerouted(want, got)
    other = other_blocks | experts
    why = f"other blocks at steps {sorted(other_blocks)}, other experts at {sorted(experts)}"
    assert len(other) <= len(got.output_ids) // 8, f"{what}: {why}"
    if other:  # the run's report names the steps left out
        warnings.warn(f"{what}: logprobs not compared at {why}", stacklevel=2)
    assert_same_generation(
        _without_steps(want, other),
        _without_steps(got, other),
        atol=BF16_NOISE,
        what=f"{what} ({why})",
    )


def _without_steps(generation: Generation, steps: frozenset[int]) -> Generation:
    """``generation`` with the logprobs of ``steps`` blanked (0.0, no alternatives); its tokens
    are kept, so they must still agree, and every other step keeps its index."""
    return dataclasses.replace(
        generation,
        logprobs=tuple(0.0 if s in steps else lp for s, lp in enumerate(generation.logprobs)),
        top_logprobs=tuple(
            () if s in steps else top for s, top in enumerate(generation.top_logprobs)
        ),
    )


def _live_leases(engine: Engine) -> float:
    return engine.metric("qsa_hisparse_live_leases")


def _released(engine: Engine, outcome: str) -> float:
    """Leases given back with ``outcome``, read once none is live.

    A request's reply can reach the client before SGLang releases its row; the lifecycle counts
    the outcome before it lowers the live gauge, so the count is final once the gauge reads 0.
    """
    _wait_for(lambda: _live_leases(engine) == 0, "every lease to come back")
    return engine.metric("qsa_hisparse_leases_released_total", outcome=outcome)


class _Background:
    """One ``/generate`` call on a thread; ``reply`` holds what it answered."""

    def __init__(self, engine: Engine, body: dict[str, object]) -> None:
        self.reply: dict[str, object] | None = None
        self.error: EngineRequestError | None = None
        self._thread = threading.Thread(target=self._run, args=(engine, body), daemon=True)
        self._thread.start()

    def _run(self, engine: Engine, body: dict[str, object]) -> None:
        try:
            self.reply = engine.post_json("/generate", body)
        except EngineRequestError as exc:  # an aborted request may answer with an error
            self.error = exc

    def join(self) -> None:
        """Wait for the reply (a hang fails past the hang guard)."""
        wait_until("/generate's reply", lambda: not self._thread.is_alive())

    @property
    def completion_tokens(self) -> int:
        assert self.reply is not None, self.error
        meta = self.reply["meta_info"]
        assert isinstance(meta, dict)
        return int(meta["completion_tokens"])


def _wait_for(condition: Callable[[], bool], what: str = "the engine's gauges") -> None:
    wait_until(what, condition, poll_s=0.01)


def _value(engine: Engine, metric: str) -> float:
    return engine.metric(metric)


@pytest.mark.engine(LIFECYCLE)
def test_offloaded_decode_chooses_upstreams_tokens_within_bf16_noise(
    engines: EnginePool, references: References
) -> None:
    engine = engines.engine(LIFECYCLE)
    steps_before = _value(engine, "qsa_hisparse_offload_decode_steps_total")
    fetched_before = _value(engine, "qsa_hisparse_fetched_blocks_total")
    for request in SPARSE_PROMPTS:
        got, trace = _traced(engine, request)
        want = references.text[request]
        traces = (references.selections[request], trace) if trace is not None else ()
        # Where a near-tie of the indexer's scores let the engines select other blocks, or of a
        # router's gate logits sent a token to another expert, the step's logprobs may move by
        # more than bf16 noise; its token must still agree. Such ties are rare (none on the CPU);
        # at many steps they would be a wrong read.
        _assert_as_upstream(
            want,
            got,
            f"{len(request.input_ids)}-token prompt",
            other_blocks=_other_selections(request, want, got, traces),
        )
    log = engine.log_path.read_text(encoding="utf-8", errors="replace")
    tree_cache = "Tree cache initialized: source=registered('qsa_hisparse') impl=HiSparseRadixCache"
    assert tree_cache in log
    assert "the QSA layers attend through HiSparseOffloadBackend" in log
    # Every decode step went through the host arena: 63 per request (the first token comes from
    # the prefill), and the sparse prompts' first steps fetched their selected blocks from host.
    steps = _value(engine, "qsa_hisparse_offload_decode_steps_total") - steps_before
    assert steps >= 3 * 63
    assert _value(engine, "qsa_hisparse_selected_blocks_total") > 0
    assert _value(engine, "qsa_hisparse_fetched_blocks_total") - fetched_before >= 512
    assert _value(engine, "qsa_hisparse_host_arena_bytes") > 0
    assert _value(engine, "qsa_hisparse_offload_rows_in_use") == 0
    assert _live_leases(engine) == 0


@pytest.mark.engine(LIFECYCLE)
def test_concurrent_requests_decode_together_and_give_every_lease_back(
    engines: EnginePool, references: References
) -> None:
    want = [references.text[request] for request in CONCURRENT]
    engine = engines.engine(LIFECYCLE)
    finished_before = _released(engine, "finished")
    calls = [_Background(engine, request.body()) for request in CONCURRENT]
    for call in calls:
        call.join()
        assert call.completion_tokens == 16
    for request, expected, call in zip(CONCURRENT, want, calls, strict=True):
        assert call.reply is not None
        _assert_as_upstream(
            expected,
            Generation.from_reply(call.reply),
            f"concurrent {len(request.input_ids)}-token prompt",
        )
    assert _live_leases(engine) == 0
    assert _released(engine, "finished") == finished_before + 3
    assert _value(engine, "qsa_hisparse_offload_rows_in_use") == 0


@pytest.mark.engine(LIFECYCLE)
def test_a_batch_of_prompts_prefills_two_at_a_time_and_answers_as_upstream(
    engines: EnginePool, references: References
) -> None:
    """Three 710-712-token prompts in one ``/generate`` call (SGLang queues them together), on an
    engine whose prefill batches hold two requests in 1,024-token chunks: the first batch stages
    the first prompt and the head of the second side by side, the next the second's rest and
    the head of the third (the first handed off to make room). Every answer equals upstream's
    within bf16 noise, two prompts were staged at once, and every lease comes back."""
    engine = engines.engine(LIFECYCLE)
    # Overlapped: the second batch is launched before the first one's result (its checkpoint
    # calls) is processed, so the offload must know from the forward that a prompt is whole.
    assert engine.get_json("/server_info")["disable_overlap_schedule"] is False
    finished_before = _released(engine, "finished")
    body = dataclasses.replace(CONCURRENT[0], routed_experts=False).body()
    body["input_ids"] = [list(r.input_ids) for r in CONCURRENT]
    replies = engine.post_json("/generate", body)
    assert isinstance(replies, list)
    assert len(replies) == len(CONCURRENT)
    for request, reply in zip(CONCURRENT, replies, strict=True):
        assert_same_generation(  # one call's requests share its routed-experts window: none asked
            references.text[request],
            Generation.from_reply(reply),
            atol=BF16_NOISE,
            what=f"batched {len(request.input_ids)}-token prompt",
        )
    assert _value(engine, "qsa_hisparse_offload_staged_prompts_peak") == 2
    assert _released(engine, "finished") == finished_before + 3
    assert _value(engine, "qsa_hisparse_offload_rows_in_use") == 0


def _resident_bytes_per_token() -> int:
    """K and V bytes one token takes in SGLang's pool for the QSA layers (bf16)."""
    text = QWEN.text_config
    layers = list(text["layer_types"]).count("full_attention")
    return layers * 2 * int(text["num_key_value_heads"]) * int(text["head_dim"]) * 2


@pytest.mark.engine(LIFECYCLE)
def test_the_host_holds_every_token_byte_for_byte_as_sglangs_pool_would(
    engines: EnginePool,
) -> None:
    """Each released row's arena blocks and tail equal a resident copy of its K/V."""
    engine = engines.engine(LIFECYCLE)
    verified = "qsa_hisparse_offload_verified_bytes_total"
    before = _value(engine, verified)
    prompt, new = 1203, 9  # 300 complete blocks and 3 tokens, then 8 decode tokens
    call = _Background(engine, GenerateRequest(QWEN.prompt(prompt, seed=50), new).body())
    call.join()
    assert call.completion_tokens == new
    # The last generated token is never fed back, so the row holds prompt + new - 1 tokens.
    expected = (prompt + new - 1) * _resident_bytes_per_token()
    _wait_for(lambda: _value(engine, verified) - before == expected, "the row's verification")
    # Nothing any test sent to this engine (finished, aborted, concurrent) differed.
    assert _value(engine, "qsa_hisparse_offload_differing_bytes_total") == 0
    log = engine.log_path.read_text(encoding="utf-8", errors="replace")
    assert f"{prompt + new - 1} tokens, {expected} K/V bytes on the host equal" in log


@pytest.mark.engine(LIFECYCLE)
def test_a_prompt_longer_than_the_context_is_refused_and_takes_nothing(
    engines: EnginePool,
) -> None:
    engine = engines.engine(LIFECYCLE)
    released_before = sum(_released(engine, o) for o in ("finished", "aborted", "retracted"))
    with pytest.raises(EngineRequestError, match="longer than the model's context length"):
        engine.post_json("/generate", GenerateRequest(QWEN.prompt(9000, seed=40)).body())
    assert _live_leases(engine) == 0
    assert _value(engine, "qsa_hisparse_offload_rows_in_use") == 0
    released = sum(_released(engine, o) for o in ("finished", "aborted", "retracted"))
    assert released == released_before  # no lease was taken for it


#: Prompts the model cannot serve. Without the plugin's check each stops SGLang's scheduler (an
#: id outside the vocabulary fails the forward pass) and with it the server.
UNSERVABLE_PROMPTS = (
    pytest.param((5, -1, 7), "prompt token 1 has id -1", id="negative-id"),
    pytest.param((QWEN.vocab_size, 5), f"prompt token 0 has id {QWEN.vocab_size}", id="past-vocab"),
)


@pytest.mark.engine(LIFECYCLE)
@pytest.mark.parametrize(("input_ids", "named"), UNSERVABLE_PROMPTS)
def test_a_prompt_the_model_cannot_serve_is_answered_400_and_the_server_serves_on(
    engines: EnginePool, input_ids: tuple[int, ...], named: str
) -> None:
    engine = engines.engine(LIFECYCLE)
    released_before = sum(_released(engine, o) for o in ("finished", "aborted", "retracted"))
    bad = GenerateRequest(input_ids, max_new_tokens=2)
    with pytest.raises(EngineRequestError, match=rf"answered 400: .*{named}.*allowed: \[0, "):
        engine.post_json("/generate", bad.body())
    assert engine.running
    released = sum(_released(engine, o) for o in ("finished", "aborted", "retracted"))
    assert released == released_before  # nothing reached the scheduler
    assert len(engine.generate(GenerateRequest(QWEN.prompt(40, seed=41), 2)).output_ids) == 2
    assert _live_leases(engine) == 0


def _abort_while_running(
    engine: Engine, request: GenerateRequest, until: Callable[[], bool] = lambda: True
) -> _Background:
    """Send ``request``, abort it once it holds its lease and ``until()`` holds, and check that the
    lease comes back as aborted; return the finished call.

    On a busy machine the request may finish before the abort reaches the scheduler; then its
    lease must come back as finished, and the request is sent again (at most
    :data:`ABORT_ATTEMPTS` times).
    """
    for _ in range(ABORT_ATTEMPTS):
        aborted_before, finished_before = (_released(engine, o) for o in ("aborted", "finished"))
        rid = uuid.uuid4().hex
        call = _Background(engine, {**request.body(), "rid": rid})
        _wait_for(lambda: _live_leases(engine) == 1 and until(), "the request to be running")
        engine.post("/abort_request", {"rid": rid})
        call.join()
        _wait_for(lambda: _live_leases(engine) == 0, "the aborted request's lease to come back")
        if _released(engine, "aborted") == aborted_before + 1:
            assert _released(engine, "finished") == finished_before
            return call
        # The abort came too late: the request was served whole, and its lease says so.
        assert _released(engine, "finished") == finished_before + 1
        assert call.completion_tokens > 0
    pytest.fail(f"the request finished before its abort in each of {ABORT_ATTEMPTS} attempts")


#: Requests :func:`_abort_while_running` sends before it gives up on aborting one mid-run.
ABORT_ATTEMPTS = 5


def test_a_switch_of_thousands_of_digits_stops_the_engine_at_start_up(tmp_path: Path) -> None:
    """Not an engine that serves without the plugin: the parser names the switch, and activation
    stops the process whatever the error (SGLang's load_plugins() logs an Exception and goes
    on)."""
    hot_blocks = "SGLANG_QSA_HISPARSE_HOT_BLOCKS"
    config = EngineConfig(
        QWEN, switches={**OFFLOAD_SWITCHES, hot_blocks: "9" * 5000}, server_args=OFFLOAD_ARGS
    )
    with pytest.raises(EngineStartError) as caught:
        start_engine(config, tmp_path / "engine").close()
    assert f"{hot_blocks}='99999999999999999999...9999999999 (5000 characters)'" in str(
        caught.value
    )


@pytest.mark.parametrize("offloaded", [True, False], ids=["offloaded", "resident"])
def test_cache_sharding_beyond_one_kv_heads_ranks_stops_the_engine_at_start_up(
    tmp_path: Path, offloaded: bool
) -> None:
    """At TP1 a K/V head has one rank: a shard group of 2 is refused by name before the model
    loads, with the offload or resident (the sharded prefill and decode are tested on gloo
    ranks: no TP engine runs on the CPU)."""
    switches = OFFLOAD_SWITCHES if offloaded else {}
    config = EngineConfig(
        QWEN,
        switches={**switches, "SGLANG_QSA_CACHE_SHARDING": "2"},
        server_args=OFFLOAD_ARGS if offloaded else {},
    )
    with pytest.raises(EngineStartError) as caught:
        start_engine(config, tmp_path / "engine").close()
    text = str(caught.value)
    for fragment in ("SGLANG_QSA_CACHE_SHARDING=2 does not fit --tp-size=1", "allowed: [1]"):
        assert fragment in text, text


@pytest.mark.engine(LIFECYCLE)
def test_abort_during_decode_gives_the_lease_back(engines: EnginePool) -> None:
    engine = engines.engine(LIFECYCLE)
    request = GenerateRequest(QWEN.prompt(200, seed=20), max_new_tokens=3000)
    steps = "qsa_hisparse_offload_decode_steps_total"
    before = _value(engine, steps)
    # Aborted once it has decoded a few steps, however slow the machine is.
    call = _abort_while_running(engine, request, until=lambda: _value(engine, steps) > before + 2)
    assert 0 < call.completion_tokens < 3000


@pytest.mark.engine(LIFECYCLE)
def test_abort_during_chunked_prefill_gives_the_lease_back(engines: EnginePool) -> None:
    # 7,900 tokens prefill in eight 1,024-token chunks; the abort, sent as soon as the request
    # holds its lease (its first chunk), reaches the scheduler while the other seven run.
    request = GenerateRequest(QWEN.prompt(7900, seed=21), max_new_tokens=4)
    call = _abort_while_running(engines.engine(LIFECYCLE), request)
    assert call.completion_tokens == 0  # aborted before its prompt was fully prefilled


@pytest.mark.engine(LIFECYCLE)
def test_flush_succeeds_once_every_lease_is_back(engines: EnginePool) -> None:
    engine = engines.engine(LIFECYCLE)
    _wait_for(lambda: _live_leases(engine) == 0)
    engine.flush_cache()
    assert "cache flush refused" not in engine.log_path.read_text(
        encoding="utf-8", errors="replace"
    )


@pytest.mark.engine(RETRACTING)
def test_a_retracted_request_gives_its_lease_back_and_takes_a_new_one(
    engines: EnginePool,
) -> None:
    engine = engines.engine(RETRACTING)
    calls = [
        _Background(engine, GenerateRequest(QWEN.prompt(400, seed=s), max_new_tokens=500).body())
        for s in (30, 31, 32)
    ]
    for call in calls:
        call.join()
        assert call.completion_tokens == 500
    retractions = 0
    for call in calls:
        assert call.reply is not None
        meta = call.reply["meta_info"]
        assert isinstance(meta, dict)
        retractions += int(meta["num_retractions"])
    assert retractions >= 1
    assert _released(engine, "retracted") == retractions
    assert _live_leases(engine) == 0
    # Every row given back, retracted ones too, held exactly its tokens' K/V.
    assert _value(engine, "qsa_hisparse_offload_verified_bytes_total") > 0
    assert _value(engine, "qsa_hisparse_offload_differing_bytes_total") == 0
    # The operator was told at start-up why requests would wait: 1,536 pool tokens hold one
    # request of the 1,024-token context, against 4 rows.
    log = engine.log_path.read_text(encoding="utf-8", errors="replace")
    assert (
        "offload: the K/V pool holds 1536 tokens, room for 1 request(s) of the 1024-token "
        "context at once, against 4 request rows" in log
    )


# ---- the host prefix cache -----------------------------------------------------------------------

#: Checkpoints of the tiny model take about 0.6 MB per 1,024 tokens (512 B of K/V and 64 B of
#: index per token, and the recurrent state) in 1 MiB blocks: 6 MiB hold a few prompts' worth,
#: so the tests below also evict. No resident copy (no VERIFY) and pools sized by SGLang from its
#: memory budget, as an operator's engine: the capacity test above runs on it too.
PREFIX_CACHE = EngineConfig(
    QWEN,
    switches={**OFFLOAD_SWITCHES, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "6"},
    server_args={**LIFECYCLE.server_args, **SIZED_BY_MEMORY, "enable_cache_report": True},
)


@pytest.mark.engine(PREFIX_CACHE)
def test_the_same_memory_budget_holds_more_tokens_and_serves_them_alike(
    engines: EnginePool, references: References
) -> None:
    """Priced at its compressed index alone, a token costs a ninth of the resident price here."""
    request = SPARSE_PROMPTS[0]
    engine = engines.engine(PREFIX_CACHE)
    got = engine.generate(dataclasses.replace(request, cache_salt=uuid.uuid4().hex))
    offloaded = SizedPools.of(engine)
    log = engine.log_path.read_text(encoding="utf-8", errors="replace")
    assert "offload: pool sizing charges" in log
    # The tiny model's QSA layer: 512 B of K/V and 64 B of index per token; staging, hot caches,
    # tails and tables are a fixed 20 MiB. Per byte of budget, about 9x the tokens.
    ratio = offloaded.tokens_per_gb / references.resident.tokens_per_gb
    assert ratio > 5, (offloaded, references.resident)
    assert got.cached_tokens == 0
    assert_same_generation(references.text[request], got, atol=BF16_NOISE, what="sized by memory")


#: Checkpoints land where a 1,024-token prefill chunk ends (1,024 and 2,048 of a 3,000-token
#: prompt): its prompt end is not a whole number of 64-token pages.
CHUNK = 1024
#: How far two runs of one prompt in one engine may differ. On CPU they are bit for bit; on the
#: H200 two cold runs of one prompt were measured 2.3e-4 apart in the first token's logprob and
#: 1.5e-2 (one bf16 step) in a later one, with the same token ids, restored or not: a warm run
#: is held to what a cold one would do again.
RERUN_NOISE = 0.0 if current_platform() is Platform.CPU else BF16_NOISE


def _prefix_stat(engine: Engine, name: str) -> float:
    return _value(engine, f"qsa_hisparse_prefix_cache_{name}")


@pytest.mark.engine(PREFIX_CACHE)
def test_the_same_prompt_twice_reuses_its_checkpoint_and_answers_alike(
    engines: EnginePool, references: References
) -> None:
    want = references.text[REPEATED_PROMPT]  # plugin off
    engine = engines.engine(PREFIX_CACHE)
    request = REPEATED_PROMPT
    loads_before = _prefix_stat(engine, "loads_total")
    loaded_before = _prefix_stat(engine, "loaded_tokens_total")
    cold = engine.generate(request)
    warm = engine.generate(request)
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == 2 * CHUNK
    assert_same_generation(cold, warm, atol=RERUN_NOISE, what="warm against cold")
    assert_same_generation(want, warm, atol=BF16_NOISE, what="warm against upstream")
    assert _prefix_stat(engine, "loads_total") == loads_before + 1
    assert _prefix_stat(engine, "loaded_tokens_total") == loaded_before + 2 * CHUNK
    assert _prefix_stat(engine, "bytes_out_total") > 0
    assert _prefix_stat(engine, "load_back_failures_total") == 0
    assert _prefix_stat(engine, "publish_errors_total") == 0
    assert _live_leases(engine) == 0
    assert _value(engine, "qsa_hisparse_offload_rows_in_use") == 0


@pytest.mark.engine(PREFIX_CACHE)
def test_the_cache_report_credits_the_host_tier(engines: EnginePool) -> None:
    """With ``--enable-cache-report`` the reply splits the cached tokens by tier: all host.

    SGLang's OpenAI usage (``usage.prompt_tokens_details.cached_tokens``) is this reply's
    ``cached_tokens``; the tiny model has no tokenizer for the OpenAI routes.
    """
    engine = engines.engine(PREFIX_CACHE)
    body = GenerateRequest(QWEN.prompt(2100, seed=61), max_new_tokens=4).body()
    cold = engine.post_json("/generate", body)
    warm = engine.post_json("/generate", body)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] == 2 * CHUNK
    assert warm["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 2 * CHUNK}
    assert warm["output_ids"] == cold["output_ids"]


@pytest.mark.engine(PREFIX_CACHE)
def test_a_multi_turn_chat_reuses_each_earlier_turn(engines: EnginePool) -> None:
    engine = engines.engine(PREFIX_CACHE)
    shared_before = _prefix_stat(engine, "shared_bytes_total")
    history: tuple[int, ...] = ()
    cached = []
    for turn, new in enumerate((1100, 1000, 1000)):
        history += QWEN.prompt(new, seed=70 + turn)
        reply = engine.generate(GenerateRequest(history, max_new_tokens=32))
        cached.append(reply.cached_tokens)
        history += reply.output_ids
    # Turn 1 (1,100 tokens) is checkpointed at 1,024; turn 2 (2,132) reuses it and is
    # checkpointed at 2,048; turn 3 (3,164) reuses that.
    assert cached == [0, CHUNK, 2 * CHUNK], cached
    # The checkpoints at 2,048 and 3,072 copied only their last 1,024 tokens' K/V and index
    # rows; the first 1,024 and 2,048 are read from the shorter ones (512 + 64 B a token).
    assert _prefix_stat(engine, "shared_bytes_total") - shared_before == 3 * CHUNK * (512 + 64)


#: The same cache, checkpointing a prefix only the second time a request reaches it.
PREFIX_CACHE_SECOND = dataclasses.replace(
    PREFIX_CACHE,
    switches={**PREFIX_CACHE.switches, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_ADMIT": "second"},
)


@pytest.mark.engine(PREFIX_CACHE_SECOND)
def test_admission_second_copies_nothing_for_a_prompt_seen_once_and_loads_it_the_third_time(
    engines: EnginePool,
) -> None:
    engine = engines.engine(PREFIX_CACHE_SECOND)
    request = GenerateRequest(QWEN.prompt(3000, seed=62), max_new_tokens=8)
    before = {n: _prefix_stat(engine, n) for n in ("deferred_total", "bytes_in_total")}

    first = engine.generate(request)
    # Its chunk ends (1,024 and 2,048) were offered and held back: nothing copied.
    assert first.cached_tokens == 0
    assert _prefix_stat(engine, "deferred_total") == before["deferred_total"] + 2
    assert _prefix_stat(engine, "bytes_in_total") == before["bytes_in_total"]

    second = engine.generate(request)  # reaches them again: now they are checkpointed
    third = engine.generate(request)

    assert second.cached_tokens == 0
    assert _prefix_stat(engine, "bytes_in_total") > before["bytes_in_total"]
    assert third.cached_tokens == 2 * CHUNK
    assert_same_generation(first, third, atol=RERUN_NOISE, what="third (loaded) against first")
    assert _live_leases(engine) == 0


@pytest.mark.engine(PREFIX_CACHE)
def test_another_cache_salt_shares_nothing(engines: EnginePool) -> None:
    engine = engines.engine(PREFIX_CACHE)
    prompt = QWEN.prompt(2100, seed=62)
    tenant_a = engine.generate(GenerateRequest(prompt, max_new_tokens=8, cache_salt="tenant-a"))
    tenant_b = engine.generate(GenerateRequest(prompt, max_new_tokens=8, cache_salt="tenant-b"))
    again_b = engine.generate(GenerateRequest(prompt, max_new_tokens=8, cache_salt="tenant-b"))
    unsalted = engine.generate(GenerateRequest(prompt, max_new_tokens=8))
    assert (tenant_a.cached_tokens, tenant_b.cached_tokens) == (0, 0)
    assert again_b.cached_tokens == 2 * CHUNK
    assert unsalted.cached_tokens == 0
    assert_same_generation(
        tenant_a, again_b, atol=RERUN_NOISE, what="tenant b's warm run against tenant a's"
    )


@pytest.mark.engine(PREFIX_CACHE)
def test_eviction_under_a_small_budget_never_returns_a_wrong_prefix(
    engines: EnginePool,
) -> None:
    engine = engines.engine(PREFIX_CACHE)
    evictions_before = _prefix_stat(engine, "evictions_total")
    requests = [GenerateRequest(QWEN.prompt(2100, seed=80 + s), max_new_tokens=8) for s in range(4)]
    cold = [engine.generate(r) for r in requests]
    # Four prompts' checkpoints (3 MiB each) do not fit in 6 MiB: the oldest went first.
    assert _prefix_stat(engine, "evictions_total") > evictions_before
    again = [engine.generate(r) for r in reversed(requests)]
    for request, want, got in zip(reversed(requests), reversed(cold), again, strict=True):
        assert got.cached_tokens in (0, CHUNK, 2 * CHUNK)
        assert_same_generation(
            want, got, atol=RERUN_NOISE, what=f"prompt {request.input_ids[:3]} again"
        )
    assert again[0].cached_tokens == 2 * CHUNK  # the newest checkpoint survived
    assert _prefix_stat(engine, "used_bytes") <= 6 << 20
    assert _prefix_stat(engine, "publish_errors_total") == 0  # refused for room, never failed


@pytest.mark.engine(PREFIX_CACHE)
def test_a_request_that_ends_with_its_prompt_keeps_only_its_earlier_chunk_ends(
    engines: EnginePool,
) -> None:
    """One generated token: the request finishes in the batch that completes its prompt, after
    SGLang freed its recurrent state, so its prompt end (2,048) is not published; 1,024 is."""
    engine = engines.engine(PREFIX_CACHE)
    errors = _prefix_stat(engine, "publish_errors_total")
    prompt = QWEN.prompt(2 * CHUNK, seed=66)
    assert engine.generate(GenerateRequest(prompt, max_new_tokens=1)).cached_tokens == 0
    follow_up = GenerateRequest(prompt + QWEN.prompt(100, seed=67), max_new_tokens=4)
    assert engine.generate(follow_up).cached_tokens == CHUNK
    assert _prefix_stat(engine, "publish_errors_total") == errors
    assert _live_leases(engine) == 0


@pytest.mark.engine(PREFIX_CACHE)
def test_a_flush_drops_every_checkpoint(engines: EnginePool) -> None:
    engine = engines.engine(PREFIX_CACHE)
    request = GenerateRequest(QWEN.prompt(2100, seed=63), max_new_tokens=4)
    engine.generate(request)
    _wait_for(lambda: _live_leases(engine) == 0)
    engine.flush_cache()
    assert _prefix_stat(engine, "ready_entries") == 0
    assert engine.generate(request).cached_tokens == 0


@pytest.mark.engine(PREFIX_CACHE)
def test_an_ignore_eos_request_loads_the_checkpoint_and_answers_alike(
    engines: EnginePool,
) -> None:
    """With the radix cache disabled SGLang would admit an ``ignore_eos`` request on a path that
    never loads a host hit (``PrefillAdder.add_one_req_ignore_eos``); the plugin's hook admits it
    on the path that does, and it answers as the request computed whole."""
    engine = engines.engine(PREFIX_CACHE)
    request = GenerateRequest(QWEN.prompt(2100, seed=64), max_new_tokens=8)
    cold = engine.generate(request)
    ignoring = engine.generate(dataclasses.replace(request, ignore_eos=True))
    assert ignoring.cached_tokens == 2 * CHUNK
    assert_same_generation(
        cold, ignoring, atol=RERUN_NOISE, what="ignore_eos against the first run"
    )
    assert engine.generate(request).cached_tokens == 2 * CHUNK  # the checkpoint is still there
    assert _live_leases(engine) == 0


@pytest.mark.engine(PREFIX_CACHE)
def test_a_new_weights_version_drops_every_checkpoint_without_a_flush(
    engines: EnginePool,
) -> None:
    """Weights changed by any route SGLang names with a version (``/update_weight_version``,
    ``weight_version`` of an update that asks not to flush) are never served old checkpoints."""
    engine = engines.engine(PREFIX_CACHE)
    request = GenerateRequest(QWEN.prompt(2100, seed=65), max_new_tokens=4)
    engine.generate(request)
    assert engine.generate(request).cached_tokens == 2 * CHUNK
    reply = engine.post_json(
        "/update_weight_version", {"new_version": "v2", "abort_all_requests": False}
    )
    assert reply["success"], reply
    assert engine.generate(request).cached_tokens == 0
    assert engine.generate(request).cached_tokens == 2 * CHUNK  # checkpointed anew under v2
    log = engine.log_path.read_text(encoding="utf-8", errors="replace")
    assert "prefix cache: weights 'v2' replaced 'default'" in log


# ---- images in the host prefix cache ------------------------------------------------------------

#: The same model with its tokenizer and image processor: SGLang expands each placeholder into one
#: image-pad id per merged patch (4 for a 64 x 64 picture) and embeds the pixels.
QWEN_VL = tiny_qwen4_exp(vision=True)
#: The image tests compare answers, not capacities: their pools are fixed.
IMAGE_PREFIX_CACHE = EngineConfig(
    QWEN_VL,
    switches={**OFFLOAD_SWITCHES, "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "32"},
    server_args=_with_fixed_pools(PREFIX_CACHE.server_args),
)
UPSTREAM_VL = EngineConfig(
    QWEN_VL, plugin=False, server_args=_with_fixed_pools(UPSTREAM_SAME_CHUNKS.server_args)
)
IMAGE_TOKENS = QWEN_VL.image_tokens(64, 64)


def _with_image(
    text: tuple[int, ...], at: int, *, image_seed: int, max_new_tokens: int = 8
) -> GenerateRequest:
    """``text`` with one picture's placeholder inserted before position ``at``."""
    ids = text[:at] + QWEN_VL.image_placeholder + text[at:]
    return GenerateRequest(ids, max_new_tokens, image_data=(tiny_image(image_seed),))


#: A 2,994-token text prompt with one picture after its first 100 tokens: 3,000 prompt tokens.
IMAGE_REQUEST = _with_image(QWEN_VL.prompt(2994, seed=90), 100, image_seed=1, max_new_tokens=16)


def _expanded(text_tokens: int) -> int:
    """Prompt tokens SGLang counts for ``text_tokens`` ids and one expanded image placeholder."""
    return text_tokens + len(QWEN_VL.image_placeholder) - 1 + IMAGE_TOKENS


@pytest.mark.engine(IMAGE_PREFIX_CACHE)
def test_an_empty_text_prompt_is_answered_400_and_the_server_serves_on(
    engines: EnginePool,
) -> None:
    """The image engine has a tokenizer: text that tokenizes to nothing reaches the check."""
    engine = engines.engine(IMAGE_PREFIX_CACHE)
    body = {"text": "", "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(EngineRequestError, match=r"answered 400: .*the prompt has 0 tokens"):
        engine.post_json("/generate", body)
    assert engine.running
    reply = engine.generate(GenerateRequest(QWEN_VL.prompt(40, seed=42), max_new_tokens=2))
    assert len(reply.output_ids) == 2
    assert _live_leases(engine) == 0


@pytest.mark.engine(IMAGE_PREFIX_CACHE)
def test_the_same_image_prompt_twice_reuses_its_checkpoint_and_answers_alike(
    engines: EnginePool, image_reference: Generation
) -> None:
    request = IMAGE_REQUEST
    want = image_reference  # plugin off
    engine = engines.engine(IMAGE_PREFIX_CACHE)
    cold = engine.generate(request)
    warm = engine.generate(request)
    assert cold.prompt_tokens == want.prompt_tokens == _expanded(2994) == 3000
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 2 * CHUNK)
    assert_same_generation(cold, warm, atol=RERUN_NOISE, what="warm against cold")
    assert_same_generation(want, cold, atol=BF16_NOISE, what="cold against upstream")
    assert _prefix_stat(engine, "publish_errors_total") == 0
    assert _live_leases(engine) == 0


@pytest.mark.engine(IMAGE_PREFIX_CACHE)
def test_the_same_token_ids_with_another_image_share_nothing(engines: EnginePool) -> None:
    """Both requests name one caller hash (``mm_hashes``), so SGLang pads both images with the
    same ids: the prompts are the same token ids; only the pictures' content tells them apart."""
    engine = engines.engine(IMAGE_PREFIX_CACHE)
    text = QWEN_VL.prompt(2994, seed=91)

    def generate(image_seed: int) -> Generation:
        body = _with_image(text, 100, image_seed=image_seed).body()
        return Generation.from_reply(engine.post_json("/generate", {**body, "mm_hashes": ["9e"]}))

    bypassed = _prefix_stat(engine, "bypassed_total")
    assert generate(image_seed=2).cached_tokens == 0
    assert generate(image_seed=3).cached_tokens == 0  # its pages from 64 on hold another image
    assert generate(image_seed=3).cached_tokens == 2 * CHUNK  # and it has its own checkpoints
    assert generate(image_seed=2).cached_tokens == 2 * CHUNK
    assert _prefix_stat(engine, "bypassed_total") == bypassed  # keyed, not bypassed


@pytest.mark.engine(IMAGE_PREFIX_CACHE)
def test_a_checkpoint_inside_an_image_resumes_in_the_middle_of_it(engines: EnginePool) -> None:
    """The 1,024-token chunk ends between the image's pads: the warm run embeds the rest of it."""
    engine = engines.engine(IMAGE_PREFIX_CACHE)
    request = _with_image(QWEN_VL.prompt(1494, seed=92), CHUNK - 2, image_seed=4, max_new_tokens=16)
    cold = engine.generate(request)
    warm = engine.generate(request)
    assert cold.prompt_tokens == _expanded(1494)
    assert (cold.cached_tokens, warm.cached_tokens) == (0, CHUNK)
    assert_same_generation(
        cold, warm, atol=RERUN_NOISE, what="resumed inside the image against cold"
    )


@pytest.mark.engine(IMAGE_PREFIX_CACHE)
def test_text_before_an_image_reuses_the_text_prompts_checkpoints(engines: EnginePool) -> None:
    """Pages without an image key as the same tokens of a text prompt do."""
    engine = engines.engine(IMAGE_PREFIX_CACHE)
    text = QWEN_VL.prompt(2100, seed=93)
    request = _with_image(text + QWEN_VL.prompt(900, seed=94), 2100, image_seed=5)
    assert engine.generate(GenerateRequest(text, max_new_tokens=1)).cached_tokens == 0
    reference = engine.generate(dataclasses.replace(request, cache_salt="cold-reference"))
    warm = engine.generate(request)
    assert (reference.cached_tokens, warm.cached_tokens) == (0, 2 * CHUNK)
    assert_same_generation(
        reference, warm, atol=RERUN_NOISE, what="image prompt after its text prefix's checkpoint"
    )


@pytest.mark.engine(IMAGE_PREFIX_CACHE)
def test_a_text_prompt_never_matches_an_image_checkpoint(engines: EnginePool) -> None:
    """The same ids as an image prompt, pads included, without the picture: computed anew.

    SGLang's own pad ids (derived from the image's hash) differ from these too; where they
    coincide, the page identities keep the prompts apart (the ``mm_hashes`` test above)."""
    engine = engines.engine(IMAGE_PREFIX_CACHE)
    text = QWEN_VL.prompt(2994, seed=95)
    request = _with_image(text, 100, image_seed=6, max_new_tokens=8)
    assert engine.generate(request).cached_tokens == 0
    start, pad, end = QWEN_VL.image_placeholder
    same_ids = text[:100] + (start,) + (pad,) * IMAGE_TOKENS + (end,) + text[100:]
    as_text = engine.generate(GenerateRequest(same_ids, max_new_tokens=8))
    assert as_text.prompt_tokens == _expanded(2994)
    assert as_text.cached_tokens == 0
    assert engine.generate(request).cached_tokens == 2 * CHUNK  # the image's checkpoint stays
