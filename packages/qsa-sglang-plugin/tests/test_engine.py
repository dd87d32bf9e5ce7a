"""Real SGLang 0.5.23 engines serving tiny dummy models, with and without this plugin.

Upstream SGLang (no plugin loaded) is the reference every wiring test compares against. These
tests pin that the reference is worth comparing against: it is deterministic across fresh
engines, its dummy weights carry signal, chunking does not change it, and a one-block change in
what decode attention reads shows in the logprobs. Then: the plugin loaded with no switch set
changes nothing.

Each configuration's engine starts once per session (``engines`` fixture); results are kept, so a
comparison never needs two engines at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from qsa_testing import (
    BF16_LOGIT_STEP,
    EngineConfig,
    EnginePool,
    GenerateRequest,
    Generation,
    Platform,
    assert_same_generation,
    current_platform,
    logprob_gap,
    platform_standins,
    tiny_llama,
    tiny_qwen4_exp,
)
from qsa_testing.standins import STANDINS, StandIn

QWEN = tiny_qwen4_exp()
LLAMA = tiny_llama()

#: Longer than the selection budget plus one open block (2,051 tokens): decode is really sparse.
LONG = GenerateRequest(QWEN.prompt(3000, seed=1), max_new_tokens=8)
OTHER = GenerateRequest(QWEN.prompt(3000, seed=2), max_new_tokens=8)
#: Shorter than the budget: every token is selected.
SHORT = GenerateRequest(QWEN.prompt(300, seed=3), max_new_tokens=8)
QWEN_REQUESTS = (LONG, OTHER, SHORT)
LLAMA_REQUESTS = (
    GenerateRequest(LLAMA.prompt(500, seed=4), max_new_tokens=8),
    GenerateRequest(LLAMA.prompt(37, seed=5), max_new_tokens=8),
)

#: Decode and prefill are different kernels over the same K/V; they agree within one bf16 step of
#: the chosen logit (3.7e-4 measured on one CPU, 7.4e-3 on another: :data:`BF16_LOGIT_STEP`).
DECODE_PREFILL_ATOL = BF16_LOGIT_STEP

#: CUDA only: how far a prefill chunk with a prefix moves the first token's logprobs and top
#: alternatives (up to 7.9e-3 measured on the H200).
CUDA_PREFIX_PREFILL_ATOL = 2e-2

UPSTREAM = EngineConfig(QWEN, plugin=False)
UPSTREAM_TWIN = EngineConfig(QWEN, plugin=False, replica=1)
PLUGIN_IDLE = EngineConfig(QWEN)
CHUNKED = EngineConfig(QWEN, plugin=False, server_args={"chunked_prefill_size": 1024})
PERTURBED = EngineConfig(QWEN, plugin=False, standins={StandIn.PERTURB_DECODE_SELECTION})
LLAMA_UPSTREAM = EngineConfig(LLAMA, plugin=False)
LLAMA_TWIN = EngineConfig(LLAMA, plugin=False, replica=1)
LLAMA_PLUGIN_IDLE = EngineConfig(LLAMA)


#: Decode steps whose logprob is compared with a prefill of the prompt and the tokens before it.
DECODE_STEPS = (1, 3, 7)


@dataclass(frozen=True, slots=True)
class QwenReferences:
    """What the upstream Qwen4Exp engines answered (a module fixture of :data:`REFERENCES`, so
    taken before any other engine of the module starts).

    Attributes:
        qwen: :data:`UPSTREAM`'s answers to :data:`QWEN_REQUESTS`.
        twin: :data:`UPSTREAM_TWIN`'s answers to the same: a second fresh engine, whose distance
            from the first is the noise floor of any comparison of two engines.
        prefilled: per step ``k`` of :data:`DECODE_STEPS`, :data:`UPSTREAM`'s answer to the long
            prompt followed by the first ``k`` tokens it decoded.
    """

    qwen: tuple[Generation, ...]
    twin: tuple[Generation, ...]
    prefilled: dict[int, Generation]


@pytest.fixture(scope="module")
def qwen_references(engines: EnginePool) -> QwenReferences:
    qwen = engines.generate_all(UPSTREAM, QWEN_REQUESTS)
    decoded = qwen[0]
    prefilled = {
        k: engines.generate(
            UPSTREAM,
            GenerateRequest(
                LONG.input_ids + decoded.output_ids[:k], max_new_tokens=1, top_logprobs=0
            ),
        )
        for k in DECODE_STEPS
    }
    return QwenReferences(qwen, engines.generate_all(UPSTREAM_TWIN, QWEN_REQUESTS), prefilled)


@pytest.fixture(scope="module")
def llama_references(engines: EnginePool) -> tuple[Generation, ...]:
    """:data:`LLAMA_UPSTREAM`'s answers to :data:`LLAMA_REQUESTS`."""
    return engines.generate_all(LLAMA_UPSTREAM, LLAMA_REQUESTS)


#: The module fixtures of reference answers, taken before the tests that use them (see
#: ``qsa_testing.pytest_plugin``).
REFERENCES = ("qwen_references", "llama_references")


def test_long_prompt_outgrows_the_selection_budget() -> None:
    profile = QWEN.qsa_profile()
    dense_limit = profile.budget + profile.compress_ratio - 1
    assert dense_limit == 2051
    assert len(LONG.input_ids) > dense_limit
    assert len(SHORT.input_ids) < dense_limit


@pytest.mark.parametrize("generated", DECODE_STEPS)
def test_a_decode_step_equals_prefill_of_the_prompt_and_the_tokens_before_it(
    qwen_references: QwenReferences, generated: int
) -> None:
    """Decode reads the cached K/V of every earlier token as prefill computes it from scratch."""
    decoded = qwen_references.qwen[0]
    prefilled = qwen_references.prefilled[generated]
    assert prefilled.output_ids[0] == decoded.output_ids[generated]
    assert abs(prefilled.logprobs[0] - decoded.logprobs[generated]) <= DECODE_PREFILL_ATOL


def test_upstream_engines_with_one_seed_agree_bit_for_bit(qwen_references: QwenReferences) -> None:
    first, second = qwen_references.qwen, qwen_references.twin
    for request, a, b in zip(QWEN_REQUESTS, first, second, strict=True):
        assert a.prompt_tokens == len(request.input_ids)
        assert len(a.output_ids) == request.max_new_tokens
        assert_same_generation(a, b, what=f"{len(request.input_ids)}-token prompt")


def test_dummy_weights_give_logprobs_that_vary_per_step_and_per_prompt(
    qwen_references: QwenReferences,
) -> None:
    long, other, short = qwen_references.qwen
    for generation in (long, other, short):
        assert len(set(generation.logprobs)) > 1, generation
        assert all(len(step) == LONG.top_logprobs for step in generation.top_logprobs)
    assert long.logprobs != other.logprobs
    assert long.logprobs != short.logprobs


@pytest.mark.engine(CHUNKED)
def test_chunked_prefill_equals_unchunked(
    engines: EnginePool, qwen_references: QwenReferences
) -> None:
    """Bit for bit on the CPU. On CUDA a chunk with a prefix takes upstream's other prefill
    kernel, so the first token's logprobs (prefill's output) move within bf16 rounding, while
    every decode step, which reads the same K/V, stays bit-identical."""
    for request, whole, chunked in zip(
        QWEN_REQUESTS,
        qwen_references.qwen,
        engines.generate_all(CHUNKED, QWEN_REQUESTS),
        strict=True,
    ):
        what = f"{len(request.input_ids)}-token prompt"
        if current_platform() is Platform.CPU:
            assert_same_generation(whole, chunked, what=what)
        else:
            assert_same_generation(whole, chunked, atol=CUDA_PREFIX_PREFILL_ATOL, what=what)
            assert whole.logprobs[1:] == chunked.logprobs[1:], what


@pytest.mark.engine(PERTURBED)
def test_a_wrong_block_in_decode_attention_changes_the_logprobs(
    engines: EnginePool, qwen_references: QwenReferences
) -> None:
    """Dropping one of 512 selected blocks moves every decode step's logprob.

    The tiny model's attention is diffuse, so the shift is small (the largest of 7 steps 1.5e-2
    on one CPU, 3.9e-4 on another, 7.5e-3 on the H200), but it always stands above the noise
    floor of two fresh engines (0 on the CPU and, with the sorted top-k, on the H200): a
    comparison of two paths that read the same K/V must be exact, or its tolerance hides a
    one-block error.
    """
    reference = qwen_references.qwen[0]
    noise = logprob_gap(reference, qwen_references.twin[0])
    perturbed = engines.generate(PERTURBED, LONG)
    # The first token comes from prefill, which the perturbation leaves alone ...
    assert perturbed.logprobs[0] == reference.logprobs[0]
    # ... every later one from a decode step that read one block less.
    with pytest.raises(AssertionError, match="differ"):
        assert_same_generation(reference, perturbed)
    gaps = [abs(a - b) for a, b in zip(reference.logprobs[1:], perturbed.logprobs[1:], strict=True)]
    assert min(gaps) > 0.0, gaps
    assert max(gaps) > noise, (gaps, noise)


@pytest.mark.engine(PLUGIN_IDLE)
def test_plugin_loaded_without_switches_equals_upstream(
    engines: EnginePool, qwen_references: QwenReferences
) -> None:
    served = engines.generate_all(PLUGIN_IDLE, QWEN_REQUESTS)
    for request, upstream, plugin in zip(QWEN_REQUESTS, qwen_references.qwen, served, strict=True):
        assert_same_generation(upstream, plugin, what=f"{len(request.input_ids)}-token prompt")


@pytest.mark.engine(PLUGIN_IDLE)
def test_engine_applies_exactly_the_platform_standins(engines: EnginePool) -> None:
    """Every stand-in of the platform edits the engine, and only modules it declares.

    A stand-in declared for several modules edits those the engine loads: the test engines load
    only the tiny model's own module of SGLang's models (``SGLANG_DISABLED_MODEL_ARCHS``), and
    ``gated_rmsnorm_cpu_op``'s second module (``fla.fused_norm_gate``) is imported by other
    models only; ``test_standins.py`` edits each declared module on its own.
    """
    engines.generate(PLUGIN_IDLE, LONG)  # some stand-ins edit modules that load on first use
    applied = engines.engine(PLUGIN_IDLE).standins_applied()
    assert {name for name, _ in applied} == platform_standins(current_platform())
    for name in platform_standins(current_platform()):
        modules = {module for n, module in applied if n is name}
        assert modules, name
        assert modules <= set(STANDINS[name].modules), (name, modules)


@pytest.mark.engine(LLAMA_TWIN)
def test_upstream_llama_engines_with_one_seed_agree_bit_for_bit(
    engines: EnginePool, llama_references: tuple[Generation, ...]
) -> None:
    first = llama_references
    second = engines.generate_all(LLAMA_TWIN, LLAMA_REQUESTS)
    for a, b in zip(first, second, strict=True):
        assert len(set(a.logprobs)) > 1, a
        assert_same_generation(a, b, what="tiny Llama")
    assert logprob_gap(first[0], first[1]) > 0.0


@pytest.mark.engine(LLAMA_PLUGIN_IDLE)
def test_plugin_loaded_without_switches_equals_upstream_on_llama(
    engines: EnginePool, llama_references: tuple[Generation, ...]
) -> None:
    upstream = llama_references
    plugin = engines.generate_all(LLAMA_PLUGIN_IDLE, LLAMA_REQUESTS)
    for a, b in zip(upstream, plugin, strict=True):
        assert_same_generation(a, b, what="tiny Llama")
