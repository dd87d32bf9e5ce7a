"""Two tensor-parallel ranks on the CPU: a real SGLang 0.5.23 engine at ``--tp-size 2``.

SGLang 0.5.23 runs tensor parallelism on the CPU once PyNccl stays off: the harness names an NCCL
library that does not load and splits the cores between the ranks (``qsa_testing`` does both for
any CPU engine with ``tp_size`` > 1; the ranks' all-reduces then run over gloo). Each rank draws
its shard of the dummy weights with the same seed, so two engines at TP2 serve the same model.

The tiny Qwen4Exp has two K/V heads, one per rank. With ``p2-offload`` each rank offloads its own
head: its own host arena, hot caches, tails and leases. Against upstream SGLang at TP2 with the
same prefill chunks (each rank with its own host prefix cache):

- the offloaded engine answers upstream's tokens, for sparse prompts and for a batch of three;
- when a request ends, each rank's arena row holds its head's K/V byte for byte: half of a
  token's bytes on each rank;
- every lease comes back on both ranks;
- a prompt served twice resumes from the host prefix cache of each rank, bit for bit.

Double sparsity at TP2 (the tiny Llama's two K/V heads, one per rank, each rank with its heads'
channels and labels): below the threshold it answers as the dense engine at TP2 bit for bit, above
it every rank decodes its head's heavy tokens, and DS-Offload at TP2 answers as it does; each rank
prices a token at its own heads' K/V and labels.

And cache sharding at TP2 stops at start-up by name: SGLang's CPU engine pads a model's K/V heads
to a multiple of the TP size instead of replicating them, so no two ranks share a head to shard.
The compressed index has no head split, so index sharding alone (D2 without D1) runs at TP2: each
rank holds half of the index's pages, upstream's QSA backend keeps its whole K/V, and the engine
answers as upstream at TP2. With ``p2-offload`` too (the offload's GPU pool then holds half of a
token's index on each rank), the engine answers as upstream at TP2 and a checkpoint of the
sharded index resumes a prompt bit for bit.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from qsa_pytest.processes import wait_until
from qsa_testing import (
    BF16_LOGIT_STEP,
    Engine,
    EngineConfig,
    EnginePool,
    EngineStartError,
    GenerateRequest,
    Generation,
    Platform,
    assert_same_generation,
    current_platform,
    start_engine,
    tiny_llama,
    tiny_qwen4_exp,
)

pytestmark = pytest.mark.skipif(
    current_platform() is not Platform.CPU,
    reason="two TP ranks on the CPU; on GPUs the multi-GPU runs have their own session",
)

QWEN = tiny_qwen4_exp()
TP = 2
OFFLOAD_SWITCHES = {
    "SGLANG_QSA_MODEL_COMPAT": "1",
    "SGLANG_QSA_HISPARSE_V3": "p2-offload",
    "SGLANG_QSA_HISPARSE_VERIFY": "1",
    # Each rank's own host prefix cache (6 MiB): both must answer every match alike.
    "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "6",
}
COMMON_ARGS = {
    "tp_size": TP,
    "chunked_prefill_size": 1024,
    "max_running_requests": 4,
    "context_length": 8192,
}
UPSTREAM = EngineConfig(QWEN, plugin=False, server_args=COMMON_ARGS)
OFFLOADED = EngineConfig(
    QWEN,
    switches=OFFLOAD_SWITCHES,
    server_args={
        **COMMON_ARGS,
        "radix_cache_backend": "qsa_hisparse",
        "disable_overlap_schedule": True,
        "enable_metrics": True,
        "prefill_max_requests": 1,
    },
)
#: One prompt above 2,051 tokens (sparse selection) and one below, neither a multiple of 4.
SPARSE_PROMPTS = (
    GenerateRequest(QWEN.prompt(2999, seed=1), max_new_tokens=32),
    GenerateRequest(QWEN.prompt(301, seed=3), max_new_tokens=32),
)
#: Served together: one decode batch of three rows.
CONCURRENT = tuple(
    GenerateRequest(QWEN.prompt(700 + s, seed=s), max_new_tokens=16) for s in (10, 11, 12)
)
#: 300 complete blocks and 3 tokens, then 8 decode tokens.
VERIFIED = GenerateRequest(QWEN.prompt(1203, seed=50), max_new_tokens=9)
#: Served twice: checkpointed at its 1,024-token chunk ends, the second run resumes at 2,048.
REPEATED = GenerateRequest(QWEN.prompt(3000, seed=60), max_new_tokens=16)
CHUNK = 1024
#: One bf16 step of a logit in [4, 8), as in the one-rank offload tests.
BF16_NOISE = BF16_LOGIT_STEP


def _kv_bytes_per_token() -> int:
    """K and V bytes of one token in the QSA layers, every K/V head, bf16."""
    text = QWEN.text_config
    layers = list(text["layer_types"]).count("full_attention")
    return layers * 2 * int(text["num_key_value_heads"]) * int(text["head_dim"]) * 2


def _rank_lines(log: Path, pattern: str) -> dict[int, list[re.Match[str]]]:
    """Each TP rank's lines of the server log ``log`` matching ``pattern``, by rank."""
    text = log.read_text(encoding="utf-8", errors="replace")
    lines: dict[int, list[re.Match[str]]] = {}
    for match in re.finditer(r"^\[[^\]]* TP(?P<rank>\d+)\] " + pattern, text, re.M):
        lines.setdefault(int(match["rank"]), []).append(match)
    return lines


def _nothing_held(engine: Engine) -> None:
    """Wait until no rank holds a lease or an arena row.

    Rank 0 answers when its scheduler finishes a request; another rank may release its lease a
    step later, so the gauges summed over the ranks reach zero shortly after the last reply.
    """
    names = ("qsa_hisparse_live_leases", "qsa_hisparse_offload_rows_in_use")
    wait_until(
        "every rank's leases and rows back", lambda: not any(engine.metric(n) for n in names)
    )


@dataclass(frozen=True, slots=True)
class References:
    """What the engines the tests compare with answered: upstream at two ranks, the dense Llama at
    two ranks, and resident double sparsity at two ranks with the decode rows each prompt counted
    (a module fixture of :data:`REFERENCES`, taken before the module's other engines start).

    Attributes:
        upstream: upstream's answers at two ranks, by request (:data:`CONCURRENT` together).
        dense: the dense Llama's answers to :data:`DS_SHORT` and :data:`DS_LONG`.
        ds: double sparsity's answers to the same two.
        ds_rows: per prompt, the decode rows double sparsity counted by path, over the ranks.
    """

    upstream: dict[GenerateRequest, Generation]
    dense: dict[GenerateRequest, Generation]
    ds: dict[GenerateRequest, Generation]
    ds_rows: dict[GenerateRequest, dict[str, float]]


@pytest.fixture(scope="module")
def references(engines: EnginePool) -> References:
    upstream = dict(
        zip(SPARSE_PROMPTS, engines.generate_all(UPSTREAM, SPARSE_PROMPTS), strict=True)
    )
    upstream |= zip(CONCURRENT, engines.generate_together(UPSTREAM, CONCURRENT), strict=True)
    upstream[REPEATED] = engines.generate(UPSTREAM, REPEATED)
    prompts = (DS_SHORT, DS_LONG)
    dense = dict(zip(prompts, engines.generate_all(DENSE_LLAMA, prompts), strict=True))
    engine = engines.engine(DS)
    ds, ds_rows = {}, {}
    for request in prompts:
        before = _ds_rows(engine)
        ds[request] = engine.generate(request)
        wait_until(
            "every rank's decode rows",
            functools.partial(_settled_rows, engine, request, before),
        )
        ds_rows[request] = {p: n - before[p] for p, n in _ds_rows(engine).items()}
    return References(upstream, dense, ds, ds_rows)


@pytest.fixture(scope="module")
def index_references(engines: EnginePool) -> dict[GenerateRequest, Generation]:
    """Upstream's answers at two ranks to the index-sharding prompts (one at a time, then three
    in one decode batch)."""
    answers = dict(zip(INDEX_PROMPTS, engines.generate_all(UPSTREAM, INDEX_PROMPTS), strict=True))
    answers |= zip(CONCURRENT, engines.generate_together(UPSTREAM, CONCURRENT), strict=True)
    return answers


#: The module fixtures of reference answers, taken before the tests that use them (see
#: ``qsa_testing.pytest_plugin``).
REFERENCES = ("references", "index_references")


@pytest.mark.engine(OFFLOADED)
def test_two_offloading_ranks_answer_as_upstream_at_two_ranks(
    engines: EnginePool, references: References
) -> None:
    engine = engines.engine(OFFLOADED)
    steps_before = engine.metric("qsa_hisparse_offload_decode_steps_total")
    got = tuple(engine.generate(request) for request in SPARSE_PROMPTS)
    got_together = engines.generate_together(OFFLOADED, CONCURRENT)
    want = tuple(references.upstream[request] for request in SPARSE_PROMPTS + CONCURRENT)
    for request, expected, served in zip(
        SPARSE_PROMPTS + CONCURRENT, want, got + got_together, strict=True
    ):
        assert_same_generation(
            expected, served, atol=BF16_NOISE, what=f"{len(request.input_ids)}-token prompt"
        )
    backends = _rank_lines(engine.log_path, r"the QSA layers attend through HiSparseOffloadBackend")
    assert sorted(backends) == list(range(TP))
    assert engine.metric("qsa_hisparse_offload_decode_steps_total") > steps_before
    _nothing_held(engine)


@pytest.mark.engine(OFFLOADED)
def test_each_rank_holds_its_own_k_v_heads_bytes_on_the_host(engines: EnginePool) -> None:
    """Each rank's arena row equals its resident copy: one K/V head, half of a token's bytes."""
    engine = engines.engine(OFFLOADED)
    tokens = len(VERIFIED.input_ids) + VERIFIED.max_new_tokens - 1  # the last is never fed back
    per_rank = tokens * _kv_bytes_per_token() // TP
    pattern = rf"offload: row \d+: {tokens} tokens, (?P<bytes>\d+) K/V bytes on the host equal"
    engine.generate(VERIFIED)
    # Each rank checks its row when it releases the lease.
    wait_until(
        f"every rank's check of its {tokens}-token row",
        lambda: sorted(_rank_lines(engine.log_path, pattern)) == list(range(TP)),
        poll_s=0.5,
    )
    verified = _rank_lines(engine.log_path, pattern)
    assert {int(m["bytes"]) for lines in verified.values() for m in lines} == {per_rank}
    assert engine.metric("qsa_hisparse_offload_differing_bytes_total") == 0
    _nothing_held(engine)


@pytest.mark.engine(OFFLOADED)
def test_the_same_prompt_twice_resumes_from_each_ranks_host_cache(
    engines: EnginePool, references: References
) -> None:
    """Both ranks find the same checkpoint and restore their own head's part of it: the warm run
    reports 2,048 cached tokens and answers as the cold one, bit for bit."""
    _resumes_from_each_ranks_host_cache(engines.engine(OFFLOADED), references.upstream[REPEATED])


def _resumes_from_each_ranks_host_cache(engine: Engine, want: Generation) -> None:
    """:data:`REPEATED` twice: cold, then warm from 2,048 cached tokens, every rank restoring its
    part; warm equals cold bit for bit and ``want`` (upstream's) within bf16 noise."""
    loaded = "qsa_hisparse_prefix_cache_loaded_tokens_total"
    before = engine.metric(loaded)
    cold = engine.generate(REPEATED)
    warm = engine.generate(REPEATED)
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 2 * CHUNK)
    assert_same_generation(cold, warm, what="warm against cold")
    assert_same_generation(want, warm, atol=BF16_NOISE, what="warm against upstream")
    assert engine.metric(loaded) - before == TP * 2 * CHUNK  # every rank restored its part
    assert engine.metric("qsa_hisparse_prefix_cache_load_back_failures_total") == 0
    _nothing_held(engine)


# -- double sparsity at two ranks ----------------------------------------------------------------

LLAMA = tiny_llama()
DS_SWITCHES = {
    "SGLANG_QSA_DS_CHANNEL_CONFIG": str(
        Path(__file__).with_name("data") / "tiny-llama-channels.json"
    ),
    "SGLANG_QSA_DS_HEAVY_CHANNELS": "8",
    "SGLANG_QSA_DS_HEAVY_TOKENS": "64",
    "SGLANG_QSA_DS_THRESHOLD": "1024",
}
DS_ARGS = {"tp_size": TP, "attention_backend": "qsa_ds", "enable_metrics": True}
DENSE_LLAMA = EngineConfig(LLAMA, plugin=False, server_args={"tp_size": TP})
DS = EngineConfig(LLAMA, switches=DS_SWITCHES, server_args=DS_ARGS)
DS_OFFLOAD = EngineConfig(
    LLAMA,
    switches={**DS_SWITCHES, "SGLANG_QSA_DS_OFFLOAD": "1", "SGLANG_QSA_HISPARSE_VERIFY": "1"},
    server_args={
        **DS_ARGS,
        "radix_cache_backend": "qsa_hisparse",
        "disable_overlap_schedule": True,
        "prefill_max_requests": 1,
        "chunked_prefill_size": 1024,
    },
)
#: Below the 1,024-token threshold (dense rows), and above it (64 heavy tokens per K/V head).
DS_SHORT = GenerateRequest(LLAMA.prompt(500, seed=4), max_new_tokens=8)
DS_LONG = GenerateRequest(LLAMA.prompt(2000, seed=7), max_new_tokens=8)


def _ds_rows(engine: Engine) -> dict[str, float]:
    """Decode rows counted by path, summed over the ranks (each rank counts its own)."""
    return {
        p: engine.metric("qsa_hisparse_ds_decode_rows_total", path=p) for p in ("dense", "sparse")
    }


def _settled_rows(engine: Engine, request: GenerateRequest, before: dict[str, float]) -> bool:
    """Whether every rank has counted each of ``request``'s decode steps (a rank may count its
    step a moment after rank 0 answered)."""
    counted = sum(_ds_rows(engine).values()) - sum(before.values())
    return counted >= TP * (request.max_new_tokens - 1)


def test_double_sparsity_at_two_ranks_answers_as_the_dense_engine_below_the_threshold(
    references: References,
) -> None:
    assert_same_generation(references.dense[DS_SHORT], references.ds[DS_SHORT])
    steps = DS_SHORT.max_new_tokens - 1
    assert references.ds_rows[DS_SHORT] == {"dense": TP * steps, "sparse": 0}


def test_each_rank_prices_a_token_at_its_own_heads_k_v_and_labels(engines: EnginePool) -> None:
    text = LLAMA.text_config
    layers, head_dim = int(text["num_hidden_layers"]), int(text["head_dim"])
    heads = int(text["num_key_value_heads"]) // TP
    kv = layers * 2 * heads * head_dim * 2  # K and V, bf16
    labels = layers * heads * int(DS_SWITCHES["SGLANG_QSA_DS_HEAVY_CHANNELS"]) * 2
    line = rf"qsa_ds: pool sizing charges {kv + labels} B per token \({kv} B of K/V and {labels} B"
    assert sorted(_rank_lines(engines.log_path(DS), line)) == list(range(TP))


def test_double_sparsity_at_two_ranks_attends_each_ranks_heavy_tokens(
    references: References,
) -> None:
    """Above the threshold every rank decodes its K/V head's heavy tokens."""
    dense, got = references.dense[DS_LONG], references.ds[DS_LONG]
    steps = DS_LONG.max_new_tokens - 1
    assert references.ds_rows[DS_LONG] == {"dense": 0, "sparse": TP * steps}
    assert got.output_ids[0] == dense.output_ids[0]  # the prefill is dense
    assert got.logprobs[1:] != dense.logprobs[1:]


@pytest.mark.engine(DS_OFFLOAD)
def test_ds_offload_at_two_ranks_answers_as_double_sparsity_at_two_ranks(
    engines: EnginePool, references: References
) -> None:
    engine = engines.engine(DS_OFFLOAD)
    offloaded = engine.generate(DS_LONG)
    assert_same_generation(
        references.ds[DS_LONG], offloaded, atol=BF16_NOISE, what="DS-Offload against DS"
    )
    assert engine.metric("qsa_hisparse_offload_differing_bytes_total") == 0
    _nothing_held(engine)


@pytest.mark.parametrize("offloaded", [True, False], ids=["offloaded", "resident"])
def test_cache_sharding_at_two_cpu_ranks_stops_the_engine_at_start_up(
    tmp_path: Path, offloaded: bool
) -> None:
    """One K/V head at TP2 would be shared by both ranks on GPUs; the CPU engine pads it."""
    one_head = tiny_qwen4_exp(kv_heads=1)
    config = EngineConfig(
        one_head,
        switches={
            **(OFFLOAD_SWITCHES if offloaded else {}),
            "SGLANG_QSA_CACHE_SHARDING": "2",
        },
        server_args=OFFLOADED.server_args if offloaded else COMMON_ARGS,
    )
    with pytest.raises(EngineStartError) as caught:
        start_engine(config, tmp_path / "engine").close()
    text = str(caught.value)
    for fragment in (
        "SGLANG_QSA_CACHE_SHARDING=2 does not fit --tp-size=2 on the CPU",
        "pads the model's 1 K/V heads to 2",
        "allowed: [1]",
    ):
        assert fragment in text, text


# -- the compressed index sharded by page alone (D2 without D1) ------------------------------------

INDEX_SHARDED = EngineConfig(
    QWEN,
    switches={"SGLANG_QSA_MODEL_COMPAT": "1", "SGLANG_QSA_INDEX_SHARDING": "1"},
    server_args={**COMMON_ARGS, "enable_metrics": True},
)
#: Two prompts above the 2,051-token budget (sparse selection over 47 and 71 pages, both ranks'
#: pages in every row) and one below it.
INDEX_PROMPTS = (
    *SPARSE_PROMPTS,
    GenerateRequest(QWEN.prompt(4501, seed=5), max_new_tokens=16),
)


def _index_block_bytes() -> int:
    """Bytes of one compressed block of every QSA layer (bf16 keys of the index's key heads)."""
    text = QWEN.text_config
    layers = list(text["layer_types"]).count("full_attention")
    return layers * int(text["indexer_kv_heads"]) * int(text["indexer_head_dim"]) * 2


@pytest.mark.engine(INDEX_SHARDED)
def test_index_sharding_alone_at_two_ranks_answers_as_upstream_at_two_ranks(
    engines: EnginePool, index_references: dict[GenerateRequest, Generation]
) -> None:
    engine = engines.engine(INDEX_SHARDED)
    got = tuple(engine.generate(request) for request in INDEX_PROMPTS)
    got_together = engines.generate_together(INDEX_SHARDED, CONCURRENT)
    for request, served in zip(INDEX_PROMPTS + CONCURRENT, got + got_together, strict=True):
        assert_same_generation(
            index_references[request],
            served,
            atol=BF16_NOISE,
            what=f"{len(request.input_ids)}-token prompt",
        )
    # Each rank installed its index shard on the group of both ranks; upstream's QSA backend
    # attends (no plugin backend replaced it).
    installed = _rank_lines(engine.log_path, r"index sharding: .* of candidate buffers")
    assert sorted(installed) == list(range(TP))
    assert not _rank_lines(engine.log_path, r"the QSA layers attend through")


def _half_of_the_index_pages_on_each_rank(engine: Engine) -> int:
    """The pages of the index each rank's start-up line names: ``ceil(P / 2)`` of ``P`` (the
    pool's pages and the dump page) on both ranks, one pool size. Returns the rank's pages."""
    pattern = (
        r"index sharding: compressed index .* per rank \((?P<local>\d+) of (?P<pages>\d+) pages"
    )
    lines = _rank_lines(engine.log_path, pattern)
    assert sorted(lines) == list(range(TP))
    shares = {(int(m["local"]), int(m["pages"])) for found in lines.values() for m in found}
    ((local, pages),) = shares  # one pool size on both ranks
    assert local == math.ceil(pages / TP)  # half, rounded up to a whole page
    return local


@pytest.mark.engine(INDEX_SHARDED)
def test_index_sharding_alone_holds_half_of_the_index_pages_on_each_rank(
    engines: EnginePool,
) -> None:
    """Each rank's start-up line names its pages of the index (``ceil(P / 2)`` of ``P``, the
    pool's pages and the dump page), and its gauge their bytes."""
    engine = engines.engine(INDEX_SHARDED)
    local = _half_of_the_index_pages_on_each_rank(engine)
    per_rank = local * 16 * _index_block_bytes()
    for rank in range(TP):
        gauge = engine.metric("qsa_hisparse_sharded_index_bytes", tp_rank=str(rank))
        assert gauge == per_rank, (rank, gauge, per_rank)


# -- the offload with the index sharded alone (D2 without D1) --------------------------------------

#: The offload at two ranks with the index sharded over both: each rank's GPU pool holds half of
#: the index pages, its host arena its own K/V head, and its prefix cache the whole index.
OFFLOADED_INDEX_SHARDED = EngineConfig(
    QWEN,
    switches={**OFFLOAD_SWITCHES, "SGLANG_QSA_INDEX_SHARDING": "1"},
    server_args=OFFLOADED.server_args,
)


@pytest.mark.engine(OFFLOADED_INDEX_SHARDED)
def test_the_offload_with_the_index_sharded_alone_answers_as_upstream_at_two_ranks(
    engines: EnginePool, references: References
) -> None:
    """Both ranks attend through the offload's backend and select over their index shard (the
    candidates merged over both ranks), each holding half of the index pages: the answers are
    upstream's at two ranks, and every lease and row comes back."""
    engine = engines.engine(OFFLOADED_INDEX_SHARDED)
    got = tuple(engine.generate(request) for request in SPARSE_PROMPTS)
    got_together = engines.generate_together(OFFLOADED_INDEX_SHARDED, CONCURRENT)
    for request, served in zip(SPARSE_PROMPTS + CONCURRENT, got + got_together, strict=True):
        assert_same_generation(
            references.upstream[request],
            served,
            atol=BF16_NOISE,
            what=f"{len(request.input_ids)}-token prompt",
        )
    backends = _rank_lines(engine.log_path, r"the QSA layers attend through HiSparseOffloadBackend")
    installed = _rank_lines(engine.log_path, r"index sharding: .* of candidate buffers")
    priced = _rank_lines(
        engine.log_path,
        rf"offload: pool sizing charges (?P<token>\d+) B per token \(was \d+ B with the QSA "
        rf"layers' K/V; (?P<index>\d+) B of index over {TP} ranks\)",
    )
    assert sorted(backends) == sorted(installed) == sorted(priced) == list(range(TP))
    # SGLang sized each rank's pool at its share of a token's index, the offload's only cost.
    for found in priced.values():
        assert {int(m["token"]) for m in found} == {math.ceil(int(found[0]["index"]) / TP)}
    _half_of_the_index_pages_on_each_rank(engine)
    assert engine.metric("qsa_hisparse_offload_differing_bytes_total") == 0
    _nothing_held(engine)


@pytest.mark.engine(OFFLOADED_INDEX_SHARDED)
def test_a_checkpoint_of_a_sharded_index_resumes_the_same_prompt_bit_for_bit(
    engines: EnginePool, references: References
) -> None:
    """A checkpoint reads the whole index through each rank's shard (one gather over both) and a
    restore writes back each rank's pages: the warm run reports 2,048 cached tokens and answers
    as the cold one, bit for bit, and as upstream within bf16 noise."""
    engine = engines.engine(OFFLOADED_INDEX_SHARDED)
    _resumes_from_each_ranks_host_cache(engine, references.upstream[REPEATED])
