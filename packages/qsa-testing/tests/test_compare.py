"""Generation comparisons fail on any token or logprob difference, and say where."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest

from qsa_testing import (
    EngineRequestError,
    GenerateRequest,
    Generation,
    assert_same_generation,
    assert_served_from_storage,
    logprob_gap,
    routing_differences,
)


def _gen(
    ids: tuple[int, ...], lps: tuple[float, ...], tops: tuple[int, ...] = (7, 8)
) -> Generation:
    return Generation(
        output_ids=ids,
        logprobs=lps,
        top_logprobs=tuple(tuple((t, lp - i) for i, t in enumerate(tops)) for lp in lps),
        prompt_tokens=10,
        cached_tokens=0,
        finish_reason="length",
    )


def test_identical_generations_pass_at_zero_tolerance() -> None:
    a = _gen((5, 5, 6), (-1.0, -2.0, -3.0))
    assert_same_generation(a, _gen((5, 5, 6), (-1.0, -2.0, -3.0)))
    assert logprob_gap(a, a) == 0.0


def test_a_logprob_difference_fails_and_names_the_step() -> None:
    a = _gen((5, 5, 6), (-1.0, -2.0, -3.0))
    b = _gen((5, 5, 6), (-1.0, -2.0 + 1e-6, -3.0))
    assert logprob_gap(a, b) == pytest.approx(1e-6)
    with pytest.raises(AssertionError, match="step 1"):
        assert_same_generation(a, b)
    assert_same_generation(a, b, atol=1e-5)


def test_a_token_difference_fails_and_names_the_first_step() -> None:
    a = _gen((5, 5, 6), (-1.0, -2.0, -3.0))
    b = _gen((5, 9, 6), (-1.0, -2.0, -3.0))
    assert logprob_gap(a, b) == float("inf")
    with pytest.raises(AssertionError, match="token ids differ from step 1"):
        assert_same_generation(a, b, atol=10.0)


def test_different_top_alternatives_fail() -> None:
    a = _gen((5,), (-1.0,), tops=(7, 8))
    b = _gen((5,), (-1.0,), tops=(8, 7))
    with pytest.raises(AssertionError, match="top alternatives differ at step 0"):
        assert_same_generation(a, b)


def test_generation_parses_sglang_replies() -> None:
    reply = {
        "output_ids": [485, 12],
        "meta_info": {
            "prompt_tokens": 3000,
            "cached_tokens": 64,
            "finish_reason": {"type": "length", "length": 2},
            "output_token_logprobs": [[-4.9, 485, None], [-4.3, 12, None]],
            "output_top_logprobs": [[[-4.9, 485, None], [-5.0, 3, None]], [[-4.3, 12, None]]],
        },
    }
    g = Generation.from_reply(reply)
    assert g.output_ids == (485, 12)
    assert g.logprobs == (-4.9, -4.3)
    assert g.top_logprobs == (((485, -4.9), (3, -5.0)), ((12, -4.3),))
    assert (g.prompt_tokens, g.cached_tokens, g.finish_reason) == (3000, 64, "length")


def test_routed_experts_are_asked_from_the_prompts_last_position_and_parsed_per_token() -> None:
    """SGLang returns int32 ``[tokens, layers, top_k]`` as base64; the first token's forward is
    the prompt's last position."""
    request = GenerateRequest((1, 2, 3), max_new_tokens=2, routed_experts=True)
    assert request.body()["return_routed_experts"] is True
    assert request.body()["routed_experts_start_len"] == 2
    assert "return_routed_experts" not in GenerateRequest((1, 2, 3)).body()
    ids = np.array([[[0, 3], [1, 2]], [[3, 0], [2, 1]]], dtype="<i4")  # 2 tokens, 2 layers, top-2

    def reply(routed: bytes) -> dict[str, object]:
        return {
            "output_ids": [485, 12],
            "meta_info": {
                "prompt_tokens": 3,
                "finish_reason": {"type": "length"},
                "output_token_logprobs": [[-4.9, 485, None], [-4.3, 12, None]],
                "routed_experts": base64.b64encode(routed).decode(),
            },
        }

    g = Generation.from_reply(reply(ids.tobytes()))
    assert g.routed_experts == ((0, 3, 1, 2), (3, 0, 2, 1))
    with pytest.raises(EngineRequestError, match="5 ids; allowed: a multiple of the 2 tokens"):
        Generation.from_reply(reply(ids.reshape(-1)[:5].tobytes()))


def test_routing_differences_name_the_steps_where_a_layer_chose_other_experts() -> None:
    """Sets per layer (order is the weights'), up to the first differing token, both runs."""
    a = dataclasses.replace(_gen((5, 5, 6), (-1.0, -2.0, -3.0)), routed_experts=((0, 1, 2, 3),) * 3)
    same_order_swapped = dataclasses.replace(a, routed_experts=((1, 0, 3, 2),) * 3)
    assert routing_differences(a, same_order_swapped, top_k=2) == frozenset()
    other = dataclasses.replace(a, routed_experts=((0, 1, 2, 3), (0, 1, 2, 0), (3, 1, 2, 3)))
    assert routing_differences(a, other, top_k=2) == {1, 2}
    diverged = dataclasses.replace(other, output_ids=(5, 7, 6))  # step 2 decodes another context
    assert routing_differences(a, diverged, top_k=2) == {1}
    with pytest.raises(ValueError, match="routed experts for 3 and 0 steps"):
        routing_differences(a, _gen((5, 5, 6), (-1.0, -2.0, -3.0)), top_k=2)
    with pytest.raises(ValueError, match="step 0: 4 and 4 expert ids; allowed: layers of 3"):
        routing_differences(a, other, top_k=3)


def test_a_near_tie_among_alternatives_passes_only_within_the_tolerance() -> None:
    """Two alternatives 5e-5 apart may trade places when atol covers it, never at atol 0."""
    a = Generation((5,), (-1.0,), (((7, -1.0), (8, -5.16247), (9, -5.16252)),), 10, 0, "length")
    b = Generation((5,), (-1.0,), (((7, -1.0), (9, -5.16249), (8, -5.16250)),), 10, 0, "length")
    assert_same_generation(a, b, atol=1e-4)
    with pytest.raises(AssertionError, match="top alternatives differ at step 0"):
        assert_same_generation(a, b)
    with pytest.raises(AssertionError, match="top alternatives differ at step 0"):
        assert_same_generation(a, b, atol=1e-6)


def _step(choice: int, top: tuple[tuple[int, float], ...]) -> Generation:
    """One greedy step choosing ``choice``, with ``top`` as its alternatives."""
    return Generation((choice,), (dict(top)[choice],), (top,), 710, 0, "length")


def _then(first: Generation, choice: int, logprob: float) -> Generation:
    """``first`` followed by one step choosing ``choice`` at ``logprob`` (its only alternative)."""
    return Generation(
        (*first.output_ids, choice),
        (*first.logprobs, logprob),
        (*first.top_logprobs, ((choice, logprob),)),
        710,
        0,
        "length",
    )


#: Step 9 of a 710-token prompt on the H200: upstream's two best tokens one bf16 logit step
#: apart, the offload's the same two tied; greedy decoding picked each run's first.
UPSTREAM_STEP = ((239, -4.94575), (20, -4.95356), (17, -5.11762))
OFFLOAD_STEP = ((20, -4.94585), (239, -4.94585), (17, -5.11773))


def test_a_tied_choice_ends_the_comparison_within_the_tolerance() -> None:
    """Two runs that pick different tokens of one near-tie agree up to it; what follows differs."""
    upstream = _then(_step(239, UPSTREAM_STEP), 239, -4.4)
    offload = _then(_step(20, OFFLOAD_STEP), 20, -4.5)
    assert_same_generation(upstream, offload, atol=2.0**-5)
    with pytest.raises(AssertionError, match="token ids differ from step 0"):
        assert_same_generation(upstream, offload)
    with pytest.raises(AssertionError, match="token ids differ from step 0"):
        assert_same_generation(upstream, offload, atol=1e-3)


def test_a_different_choice_that_is_no_tie_fails() -> None:
    """A choice the other run ranks more than ``atol`` below its own is a different answer."""
    wide = ((20, -4.84), (239, -4.94585), (17, -5.11773))
    with pytest.raises(AssertionError, match="token ids differ from step 0"):
        assert_same_generation(_step(239, UPSTREAM_STEP), _step(20, wide), atol=2.0**-5)
    unlisted = ((20, -4.94585), (17, -5.11773))
    with pytest.raises(AssertionError, match="token ids differ from step 0"):
        assert_same_generation(_step(239, UPSTREAM_STEP), _step(20, unlisted), atol=2.0**-5)


def test_the_steps_before_a_tie_are_still_compared() -> None:
    """A logprob gap beyond ``atol`` before the tie fails, though the tie itself would pass."""
    upstream = _then(_then(_step(5, ((5, -1.0),)), 239, -4.94575), 239, -4.4)
    upstream = dataclasses.replace(
        upstream, top_logprobs=(((5, -1.0),), UPSTREAM_STEP, ((239, -4.4),))
    )
    offload = dataclasses.replace(
        upstream,
        output_ids=(5, 20, 20),
        logprobs=(-1.5, -4.94585, -4.5),
        top_logprobs=(((5, -1.5),), OFFLOAD_STEP, ((20, -4.5),)),
    )
    with pytest.raises(AssertionError, match="step 0"):
        assert_same_generation(upstream, offload, atol=2.0**-5)
    close = dataclasses.replace(offload, logprobs=(-1.0, -4.94585, -4.5))
    close = dataclasses.replace(close, top_logprobs=(((5, -1.0),), OFFLOAD_STEP, ((20, -4.5),)))
    assert_same_generation(upstream, close, atol=2.0**-5)


def _reply(cached: int, details: dict[str, int], ids: list[int]) -> dict[str, object]:
    """A ``/generate`` reply of ``ids`` (logprob -1 each) after ``cached`` prompt tokens."""
    return {
        "output_ids": ids,
        "meta_info": {
            "prompt_tokens": 10,
            "cached_tokens": cached,
            "cached_tokens_details": details,
            "output_token_logprobs": [[-1.0, i, None] for i in ids],
            "finish_reason": {"type": "length"},
        },
    }


def test_a_warm_reply_from_storage_alone_with_the_cold_tokens_passes() -> None:
    cold = _reply(0, {"device": 0, "host": 0, "storage": 0}, [5, 6])
    assert_served_from_storage(
        cold, _reply(8, {"device": 0, "host": 0, "storage": 8}, [5, 6]), 8, what="w"
    )


@pytest.mark.parametrize(
    ("cached", "details", "ids", "fragment"),
    [
        (8, {"device": 0, "host": 8, "storage": 0}, [5, 6], "expected 8 from storage alone"),
        (4, {"device": 0, "host": 0, "storage": 4}, [5, 6], "4 cached tokens"),
        (8, {"device": 0, "host": 0, "storage": 8}, [5, 7], "token ids differ from step 1"),
    ],
    ids=["from-the-host", "too-few", "other-tokens"],
)
def test_a_warm_reply_not_from_storage_or_not_the_cold_tokens_fails(
    cached: int, details: dict[str, int], ids: list[int], fragment: str
) -> None:
    cold = _reply(0, {"device": 0, "host": 0, "storage": 0}, [5, 6])
    with pytest.raises(AssertionError, match=fragment):
        assert_served_from_storage(cold, _reply(cached, details, ids), 8, what="w")
