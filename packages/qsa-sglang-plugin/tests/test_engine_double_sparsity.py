"""Double sparsity in a real SGLang 0.5.23 engine: ``--attention-backend qsa_ds`` on the tiny Llama.

One engine with the plugin's ``qsa_ds`` backend (8 heavy channels of 16, 64 heavy tokens, dense
below 1,024 tokens) against SGLang's dense backend of the platform on the same model and seed:

- below the threshold every decode row is dense, and the answer equals the dense engine's bit
  for bit (the label writes change nothing SGLang reads); so it is above the threshold when
  ``heavy_token_num`` covers the whole context (a second engine with 4,096 heavy tokens);
- above it the decode attends 64 tokens per KV head: the first token (from the dense prefill) is
  the dense engine's bit for bit, the decode steps after it are not, and the backend counts
  sparse rows;
- a malformed channel file stops the engine at start-up, naming the file and the field.

And DS-Offload (``SGLANG_QSA_DS_OFFLOAD=1``): the same backend with the K/V history in the host
arena, prefilled through a one-prompt staging area in 1,024-token chunks, every decode row
attending its chosen tokens from the hot cache and the open-block tail, eagerly or replayed from
decode CUDA graphs as the harness asks. It answers as the resident double-sparsity engine (dense
rows as the dense engine), alone and in a batch of a dense and a sparse row, holds every token's
K/V on the host byte for byte, prices a token at its labels alone, and gives every lease back.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from qsa_pytest.processes import wait_until
from qsa_testing import (
    BF16_LOGIT_STEP,
    EngineConfig,
    EnginePool,
    EngineRequestError,
    EngineStartError,
    GenerateRequest,
    Generation,
    Platform,
    assert_same_generation,
    cuda_graphs_requested,
    current_platform,
    start_engine,
    tiny_llama,
)

LLAMA = tiny_llama()
CHANNELS = Path(__file__).with_name("data") / "tiny-llama-channels.json"
THRESHOLD = 1024
HEAVY_TOKENS = 64
SWITCHES = {
    "SGLANG_QSA_DS_CHANNEL_CONFIG": str(CHANNELS),
    "SGLANG_QSA_DS_HEAVY_CHANNELS": "8",
    "SGLANG_QSA_DS_HEAVY_TOKENS": str(HEAVY_TOKENS),
    "SGLANG_QSA_DS_THRESHOLD": str(THRESHOLD),
}
#: Both engines capture decode CUDA graphs where the harness asks for them (the H200 run's
#: ``QSA_TESTING_CUDA_GRAPHS=1``) and run eagerly otherwise.
DS = EngineConfig(
    LLAMA,
    switches=SWITCHES,
    server_args={"attention_backend": "qsa_ds", "enable_metrics": True},
)
DENSE = EngineConfig(LLAMA, plugin=False)
#: Heavy tokens beyond every prompt here: a context above the threshold but within
#: ``heavy_token_num`` would select every token, so its rows decode densely.
ALL_HEAVY_TOKENS = 4096
DS_ALL_HEAVY = dataclasses.replace(
    DS, switches={**SWITCHES, "SGLANG_QSA_DS_HEAVY_TOKENS": str(ALL_HEAVY_TOKENS)}
)
#: DS-Offload with every released row's host bytes checked against a resident copy; decode CUDA
#: graphs as for DS; prefill in chunks, so later chunks attend over a staged prefix; SGLang's
#: overlap scheduling (its default), which DS-Offload serves.
DS_OFFLOAD = EngineConfig(
    LLAMA,
    switches={**SWITCHES, "SGLANG_QSA_DS_OFFLOAD": "1", "SGLANG_QSA_HISPARSE_VERIFY": "1"},
    server_args={
        "attention_backend": "qsa_ds",
        "enable_metrics": True,
        "radix_cache_backend": "qsa_hisparse",
        "disable_overlap_schedule": False,
        "prefill_max_requests": 1,
        "chunked_prefill_size": 1024,
        "cuda_graph_backend_prefill": "disabled",
    },
)
#: Within one bf16 logit step: a dense row of a mixed batch attends through another kernel.
BF16_STEP = BF16_LOGIT_STEP

SHORT = (
    GenerateRequest(LLAMA.prompt(500, seed=4), max_new_tokens=8),
    GenerateRequest(LLAMA.prompt(900, seed=6), max_new_tokens=8),
)
LONG = GenerateRequest(LLAMA.prompt(2000, seed=7), max_new_tokens=8)
#: Served together: a dense row and a sparse row in one decode batch, each all 8 tokens long.
MIXED = (
    GenerateRequest(LLAMA.prompt(600, seed=8), max_new_tokens=8, ignore_eos=True),
    GenerateRequest(LLAMA.prompt(2100, seed=9), max_new_tokens=8, ignore_eos=True),
)
PATHS = ("dense", "sparse")
MODES = ("eager", "graph")
#: How the DS engine runs its decode steps here: replayed from CUDA graphs when the harness
#: captures them (CUDA, ``QSA_TESTING_CUDA_GRAPHS=1``), else launched eagerly.
MODE = "graph" if current_platform() is Platform.CUDA and cuda_graphs_requested() else "eager"


@dataclasses.dataclass(frozen=True)
class _Served:
    """What each engine answered, and how the double-sparsity engine counted its decode rows."""

    dense: tuple[Generation, ...]
    ds: tuple[Generation, ...]
    mixed: tuple[Generation, ...]
    short_rows: dict[str, float]
    long_rows: dict[str, float]
    mixed_rows: dict[str, float]
    long_steps: dict[str, float]


def _rows(engines: EnginePool) -> dict[str, float]:
    engine = engines.engine(DS)
    return {p: engine.metric("qsa_hisparse_ds_decode_rows_total", path=p) for p in PATHS}


def _steps(engines: EnginePool) -> dict[str, float]:
    engine = engines.engine(DS)
    return {m: engine.metric("qsa_hisparse_ds_decode_steps_total", mode=m) for m in MODES}


@pytest.fixture(scope="module")
def served(engines: EnginePool) -> _Served:
    """Every request on the dense engine, then on the DS one: each engine starts once (a module
    fixture of :data:`REFERENCES`, taken before the module's other engines start)."""
    dense = engines.generate_all(DENSE, (*SHORT, LONG, *MIXED))
    before = _rows(engines)
    short = engines.generate_all(DS, SHORT)
    middle, steps_before = _rows(engines), _steps(engines)
    long = engines.generate(DS, LONG)
    after, steps_after = _rows(engines), _steps(engines)
    mixed = engines.generate_together(DS, MIXED)
    last = _rows(engines)
    return _Served(
        dense=tuple(dense),
        ds=(*short, long),
        mixed=tuple(mixed),
        short_rows={p: middle[p] - before[p] for p in PATHS},
        long_rows={p: after[p] - middle[p] for p in PATHS},
        mixed_rows={p: last[p] - after[p] for p in PATHS},
        long_steps={m: steps_after[m] - steps_before[m] for m in MODES},
    )


#: The module fixtures of reference answers, taken before the tests that use them (see
#: ``qsa_testing.pytest_plugin``).
REFERENCES = ("served",)


def test_below_the_threshold_double_sparsity_answers_as_the_dense_backend(
    served: _Served,
) -> None:
    for want, have in zip(served.dense[: len(SHORT)], served.ds[: len(SHORT)], strict=True):
        assert_same_generation(want, have)
    decode_steps = sum(r.max_new_tokens - 1 for r in SHORT)
    assert served.short_rows == {"dense": decode_steps, "sparse": 0}


def test_above_the_threshold_decode_attends_the_heavy_tokens(served: _Served) -> None:
    dense, got = served.dense[len(SHORT)], served.ds[-1]
    assert served.long_rows == {"dense": 0, "sparse": LONG.max_new_tokens - 1}
    # ... each step launched eagerly, or replayed from the captured graph where there is one.
    want_steps = dict.fromkeys(MODES, 0.0) | {MODE: LONG.max_new_tokens - 1}
    assert served.long_steps == want_steps
    # The first token comes from the prefill, which is the dense backend's.
    assert got.output_ids[0] == dense.output_ids[0]
    assert got.logprobs[0] == dense.logprobs[0]
    # Each later step attends 64 of about 2,000 tokens per KV head, and it shows.
    assert got.logprobs[1:] != dense.logprobs[1:], (got.logprobs, dense.logprobs)
    assert len(got.output_ids) == LONG.max_new_tokens


def test_a_batch_of_dense_and_sparse_rows_decides_per_row(served: _Served) -> None:
    """A short request decoding beside a long one stays dense: its answer is the dense engine's
    (within one bf16 step), and only the long one's rows count sparse."""
    short, long = MIXED
    rows = {"dense": short.max_new_tokens - 1, "sparse": long.max_new_tokens - 1}
    assert served.mixed_rows == rows
    dense_short, dense_long = served.dense[-2:]
    assert_same_generation(dense_short, served.mixed[0], atol=BF16_STEP, what="short")
    assert served.mixed[1].output_ids[0] == dense_long.output_ids[0]
    assert served.mixed[1].logprobs[1:] != dense_long.logprobs[1:]


def test_a_malformed_channel_file_stops_the_engine_at_start_up(tmp_path: Path) -> None:
    rows = json.loads(CHANNELS.read_text(encoding="utf-8"))
    rows["model.layers.1.self_attn.qk_proj"][0][3] = 16  # past head_dim 16
    bad = tmp_path / "channels.json"
    bad.write_text(json.dumps(rows), encoding="utf-8")
    config = EngineConfig(
        LLAMA,
        switches={**SWITCHES, "SGLANG_QSA_DS_CHANNEL_CONFIG": str(bad)},
        server_args={"attention_backend": "qsa_ds"},
    )
    with pytest.raises(EngineStartError) as caught:
        start_engine(config, tmp_path / "engine").close()
    text = str(caught.value)
    for fragment in (str(bad), "model.layers.1.self_attn.qk_proj", "head 0", "channel 16"):
        assert fragment in text, text


def test_the_pool_sizing_charges_each_tokens_labels(engines: EnginePool) -> None:
    """A token slot holds its K/V and its label rows; SGLang's sizing prices both."""
    text = LLAMA.text_config
    layers, kv_heads, head_dim = (
        text["num_hidden_layers"],
        text["num_key_value_heads"],
        text["head_dim"],
    )
    kv = layers * 2 * kv_heads * head_dim * 2  # K and V, bf16
    labels = layers * kv_heads * int(SWITCHES["SGLANG_QSA_DS_HEAVY_CHANNELS"]) * 2
    log = engines.log_path(DS).read_text(encoding="utf-8", errors="replace")
    line = f"qsa_ds: pool sizing charges {kv + labels} B per token ({kv} B of K/V and {labels} B"
    assert line in log


# -- DS-Offload ------------------------------------------------------------------------------------


def _offloaded(engines: EnginePool, metric: str, **labels: str) -> float:
    return engines.engine(DS_OFFLOAD).metric(metric, **labels)


def _kv_bytes_per_token() -> int:
    """K and V bytes of one token in every layer of the tiny Llama (bf16)."""
    text = LLAMA.text_config
    return (
        int(text["num_hidden_layers"])
        * 2
        * int(text["num_key_value_heads"])
        * int(text["head_dim"])
        * 2
    )


@pytest.mark.engine(DS_ALL_HEAVY)
def test_heavy_tokens_covering_the_context_answer_as_the_dense_backend(
    served: _Served, engines: EnginePool
) -> None:
    """A prompt above the threshold whose context fits ``heavy_token_num`` decodes densely: its
    answer is the dense engine's bit for bit, and every decode row counts dense."""
    assert len(LONG.input_ids) + LONG.max_new_tokens <= ALL_HEAVY_TOKENS
    assert len(LONG.input_ids) >= THRESHOLD
    engine = engines.engine(DS_ALL_HEAVY)
    before = {p: engine.metric("qsa_hisparse_ds_decode_rows_total", path=p) for p in PATHS}
    got = engines.generate(DS_ALL_HEAVY, LONG)
    after = {p: engine.metric("qsa_hisparse_ds_decode_rows_total", path=p) for p in PATHS}
    assert_same_generation(served.dense[len(SHORT)], got)
    rows = {p: after[p] - before[p] for p in PATHS}
    assert rows == {"dense": LONG.max_new_tokens - 1, "sparse": 0}


@pytest.mark.engine(DS)
@pytest.mark.parametrize("bad_id", [-3, LLAMA.vocab_size], ids=["negative", "past-vocab"])
def test_an_id_outside_the_vocabulary_is_answered_400_and_the_server_serves_on(
    engines: EnginePool, bad_id: int
) -> None:
    engine = engines.engine(DS)
    bad = GenerateRequest((1, 2, bad_id), max_new_tokens=2)
    named = rf"answered 400: .*prompt token 2 has id {bad_id}"
    with pytest.raises(EngineRequestError, match=named):
        engine.post_json("/generate", bad.body())
    assert engine.running
    assert len(engine.generate(GenerateRequest(LLAMA.prompt(40, seed=43), 2)).output_ids) == 2


@pytest.mark.engine(DS_OFFLOAD)
def test_ds_offload_answers_as_resident_double_sparsity(
    served: _Served, engines: EnginePool
) -> None:
    """The same tokens per KV head, read from the host arena: dense rows answer as the dense
    engine, sparse rows as the resident qsa_ds engine, each within one bf16 step, and the first
    token (the staged prefill's, one chunk) bit for bit."""
    rows_before = {
        p: _offloaded(engines, "qsa_hisparse_ds_decode_rows_total", path=p) for p in PATHS
    }
    modes_before = {
        m: _offloaded(engines, "qsa_hisparse_ds_decode_steps_total", mode=m) for m in MODES
    }
    short = engines.generate_all(DS_OFFLOAD, SHORT)
    long = engines.generate(DS_OFFLOAD, LONG)
    for i, (want, got) in enumerate(zip(served.dense[: len(SHORT)], short, strict=True)):
        assert got.output_ids[0] == want.output_ids[0]
        assert got.logprobs[0] == want.logprobs[0]
        assert_same_generation(want, got, atol=BF16_STEP, what=f"short prompt {i}")
    # The long prompt prefilled in two chunks, the second over the staged first. The two engines
    # attend the same tokens per KV head, one in a single pass, the other in two LSE-merged parts:
    # bit-identical on CPU so far, held to one bf16 step (their kernels differ on CUDA).
    assert_same_generation(served.ds[-1], long, atol=BF16_STEP, what="long prompt")
    rows = {
        p: _offloaded(engines, "qsa_hisparse_ds_decode_rows_total", path=p) - rows_before[p]
        for p in PATHS
    }
    short_steps = sum(r.max_new_tokens - 1 for r in SHORT)
    assert rows == {"dense": short_steps, "sparse": LONG.max_new_tokens - 1}
    # Each step launched eagerly, or replayed from a captured graph where the harness asks.
    modes = {
        m: _offloaded(engines, "qsa_hisparse_ds_decode_steps_total", mode=m) - modes_before[m]
        for m in MODES
    }
    assert modes == dict.fromkeys(MODES, 0.0) | {MODE: short_steps + LONG.max_new_tokens - 1}
    # Every decode step read the host arena: the dense rows fetched their whole prompts' blocks.
    steps = _offloaded(engines, "qsa_hisparse_offload_decode_steps_total")
    assert steps >= short_steps + LONG.max_new_tokens - 1
    assert _offloaded(engines, "qsa_hisparse_fetched_blocks_total") >= (500 + 900) // 4
    log = engines.engine(DS_OFFLOAD).log_path.read_text(encoding="utf-8", errors="replace")
    assert "Tree cache initialized: source=registered('qsa_hisparse')" in log
    assert "DS-Offload: K/V in the host arena" in log


@pytest.mark.engine(DS_OFFLOAD)
def test_ds_offload_decides_dense_and_sparse_per_row_in_one_batch(
    served: _Served, engines: EnginePool
) -> None:
    """A 600- and a 2,100-token request decoding together: the short row attends every token, the
    long one its heavy tokens, each answering as resident qsa_ds did for the same batch."""
    rows_before = {
        p: _offloaded(engines, "qsa_hisparse_ds_decode_rows_total", path=p) for p in PATHS
    }
    mixed = engines.generate_together(DS_OFFLOAD, MIXED)
    rows = {
        p: _offloaded(engines, "qsa_hisparse_ds_decode_rows_total", path=p) - rows_before[p]
        for p in PATHS
    }
    assert rows == {"dense": MIXED[0].max_new_tokens - 1, "sparse": MIXED[1].max_new_tokens - 1}
    for i, (want, got) in enumerate(zip(served.mixed, mixed, strict=True)):
        assert_same_generation(want, got, atol=BF16_STEP, what=f"mixed request {i}")


@pytest.mark.engine(DS_OFFLOAD)
def test_ds_offload_holds_every_token_on_the_host_and_gives_every_lease_back(
    engines: EnginePool,
) -> None:
    """Each released row's arena blocks and tail equal a resident copy of its K/V, byte for
    byte; afterwards no lease, row or staged prompt is held."""
    verified = "qsa_hisparse_offload_verified_bytes_total"
    before = _offloaded(engines, verified)
    prompt, new = 1203, 9  # two chunks; 300 complete blocks and 3 tokens, then 8 decode tokens
    engines.engine(DS_OFFLOAD).generate(GenerateRequest(LLAMA.prompt(prompt, seed=50), new))
    # The last generated token is never fed back, so the row holds prompt + new - 1 tokens.
    expected = (prompt + new - 1) * _kv_bytes_per_token()
    wait_until(
        "the released row's verification",
        lambda: _offloaded(engines, verified) - before == expected,
    )
    assert _offloaded(engines, "qsa_hisparse_offload_differing_bytes_total") == 0
    held = ("qsa_hisparse_live_leases", "qsa_hisparse_offload_rows_in_use")  # set after the check
    wait_until("no lease or row held", lambda: not any(_offloaded(engines, n) for n in held))
    assert _offloaded(engines, "qsa_hisparse_host_arena_bytes") > 0


@pytest.mark.engine(DS_OFFLOAD)
def test_ds_offload_prices_a_token_at_its_labels_alone(engines: EnginePool) -> None:
    """SGLang's pool holds no K/V: a token slot costs its label rows, the offload's device
    buffers are fixed overhead."""
    text = LLAMA.text_config
    layers, kv_heads = text["num_hidden_layers"], text["num_key_value_heads"]
    labels = layers * kv_heads * int(SWITCHES["SGLANG_QSA_DS_HEAVY_CHANNELS"]) * 2
    log = engines.engine(DS_OFFLOAD).log_path.read_text(encoding="utf-8", errors="replace")
    line = (
        f"qsa_ds: DS-Offload: pool sizing charges {labels} B per token of labels (was "
        f"{_kv_bytes_per_token()} B of K/V and {labels} B of labels)"
    )
    assert line in log
