"""Comparing generations: same tokens, and logprobs equal within a stated tolerance.

Dummy weights often greedy-decode one repeated token, so token equality alone proves little;
every comparison here also checks each step's logprob and its top alternatives, and says which
step differed and by how much.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

from qsa_testing._engine import Generation

__all__ = (
    "BF16_LOGIT_STEP",
    "assert_same_generation",
    "assert_served_from_storage",
    "logprob_gap",
    "routing_differences",
)

#: One bf16 step of a logit in [4, 8): the tolerance of a comparison between two paths that
#: compute the same logits through different bf16 kernels (decode against prefill, offloaded
#: against resident, a dense row of a mixed batch). Such paths round some intermediate sum the
#: other way, the chosen logit then lands one bf16 step away, and its logprob moves by up to that
#: step. How often depends on the machine's arithmetic, not on the code: decode against prefill
#: moved a logprob by 3.7e-4 on one CPU and 7.4e-3 (one step of a logit in [1, 2)) on another,
#: and offloaded against resident by 7.8e-3 and 1.55e-2 on the H200. The bound is the dtype's,
#: so it holds on any machine; a wrong K/V read that changes a token still fails.
BF16_LOGIT_STEP: Final = 2.0**-5


def logprob_gap(expected: Generation, actual: Generation) -> float:
    """The largest absolute difference between the two runs' per-step logprobs.

    Covers the chosen token's logprob and every top alternative both runs returned for the same
    token id; ``inf`` when the runs chose different tokens or returned different step counts.
    """
    if expected.output_ids != actual.output_ids:
        return float("inf")
    gap = 0.0
    for want, got in zip(expected.logprobs, actual.logprobs, strict=True):
        gap = max(gap, abs(want - got))
    for want_top, got_top in zip(expected.top_logprobs, actual.top_logprobs, strict=True):
        got_by_id = dict(got_top)
        for token, logprob in want_top:
            if token in got_by_id:
                gap = max(gap, abs(logprob - got_by_id[token]))
    return gap


def routing_differences(expected: Generation, actual: Generation, top_k: int) -> frozenset[int]:
    """The steps at which some MoE layer routed the two runs' forwards to other experts.

    Two engines that compute the same model through different kernels can hand a router hidden
    states one rounding apart; where two experts' gate logits nearly tie, that routes the token
    to another expert and moves the step's logprob by far more than the rounding, with the same
    token chosen. Compared as each layer's set of ``top_k`` experts (their order follows the
    weights, which may trade places too), up to the first step whose tokens differ (its forward
    still read the same tokens; the runs decode other contexts after it).

    Raises:
        ValueError: a run without routed experts (:attr:`GenerateRequest.routed_experts`), or a
            step whose ids do not split into layers of ``top_k``, naming the counts.
    """
    steps = len(expected.routed_experts)
    if not steps or steps != len(actual.routed_experts):
        msg = (
            f"routed experts for {len(expected.routed_experts)} and "
            f"{len(actual.routed_experts)} steps; both runs need them for every step"
        )
        raise ValueError(msg)
    first = _first_different_token(expected, actual)
    compared = steps if first is None else first + 1
    found = set()
    for step in range(compared):
        want, got = expected.routed_experts[step], actual.routed_experts[step]
        if len(want) != len(got) or len(want) % top_k:
            msg = f"step {step}: {len(want)} and {len(got)} expert ids; allowed: layers of {top_k}"
            raise ValueError(msg)
        layers = range(0, len(want), top_k)
        if any(set(want[i : i + top_k]) != set(got[i : i + top_k]) for i in layers):
            found.add(step)
    return frozenset(found)


def _steps(generation: Generation) -> Sequence[str]:
    return [
        f"{token}:{logprob:+.6f}"
        for token, logprob in zip(generation.output_ids, generation.logprobs, strict=True)
    ]


def _first_different_token(expected: Generation, actual: Generation) -> int | None:
    """The first step at which the runs chose different tokens (or one ended); None if none."""
    if expected.output_ids == actual.output_ids:
        return None
    pairs = zip(expected.output_ids, actual.output_ids, strict=False)
    return next(
        (step for step, (want, got) in enumerate(pairs) if want != got),
        min(len(expected.output_ids), len(actual.output_ids)),
    )


def _tied_choice(expected: Generation, actual: Generation, step: int, atol: float) -> bool:
    """Whether the runs' different choices at ``step`` are one near-tie seen from both sides.

    True when both runs returned alternatives at ``step`` naming both chosen tokens, each run's
    choice beats the other's by at most ``atol`` in that run, and the two chosen logprobs agree
    within ``atol``: greedy decoding of two logits one rounding apart may pick either.
    """
    if step >= min(len(expected.top_logprobs), len(actual.top_logprobs)):
        return False
    want, got = dict(expected.top_logprobs[step]), dict(actual.top_logprobs[step])
    chose_want, chose_got = expected.output_ids[step], actual.output_ids[step]
    if not {chose_want, chose_got} <= want.keys() & got.keys():
        return False
    return (
        want[chose_want] - want[chose_got] <= atol
        and got[chose_got] - got[chose_want] <= atol
        and abs(want[chose_want] - got[chose_got]) <= atol
    )


def _first_steps(generation: Generation, steps: int) -> Generation:
    """``generation`` cut to its first ``steps`` generated tokens."""
    return dataclasses.replace(
        generation,
        output_ids=generation.output_ids[:steps],
        logprobs=generation.logprobs[:steps],
        top_logprobs=generation.top_logprobs[:steps],
    )


def assert_same_generation(
    expected: Generation, actual: Generation, *, atol: float = 0.0, what: str = "generation"
) -> None:
    """Fail unless both runs chose the same tokens with logprobs within ``atol``.

    With ``atol=0.0`` (the default) the logprobs must be bit-identical, as two runs of one code
    path on one machine are. The top alternatives must name the same tokens in the same order;
    with ``atol > 0`` two alternatives whose logprobs lie within ``atol`` of each other may trade
    places (a near-tie): at every rank the logprobs must then agree within ``atol``.

    The chosen token is the first alternative, so with ``atol > 0`` it may trade places too: where
    the runs first choose different tokens, the two choices must lie within ``atol`` of each
    other in both runs (:func:`_tied_choice`), and the steps before it are compared as above.
    The runs decode on from different tokens after a tie, so no later step is compared.

    Raises:
        AssertionError: naming the first differing step, both values and the largest gap.
    """
    first = _first_different_token(expected, actual)
    if first is not None and atol > 0 and _tied_choice(expected, actual, first, atol):
        expected, actual = _first_steps(expected, first), _first_steps(actual, first)
    if expected.output_ids != actual.output_ids:
        msg = (
            f"{what}: token ids differ from step {first}:\n  expected {_steps(expected)}\n"
            f"  actual   {_steps(actual)}"
        )
        raise AssertionError(msg)
    for step, (want, got) in enumerate(
        zip(expected.top_logprobs, actual.top_logprobs, strict=True)
    ):
        if [t for t, _ in want] == [t for t, _ in got]:
            continue
        near_tie = atol > 0 and len(want) == len(got)
        near_tie = near_tie and all(
            abs(a - b) <= atol for (_, a), (_, b) in zip(want, got, strict=True)
        )
        if not near_tie:
            msg = f"{what}: top alternatives differ at step {step}: expected {want}, actual {got}"
            raise AssertionError(msg)
    gap = logprob_gap(expected, actual)
    if gap > atol:
        worst = max(
            range(len(expected.logprobs)),
            key=lambda i: abs(expected.logprobs[i] - actual.logprobs[i]),
        )
        msg = (
            f"{what}: logprobs differ by up to {gap:.3g} (allowed {atol:.3g}); step {worst}: "
            f"expected {expected.logprobs[worst]!r}, actual {actual.logprobs[worst]!r}"
        )
        raise AssertionError(msg)


def assert_served_from_storage(
    cold: Mapping[str, Any], warm: Mapping[str, Any], tokens: int, *, what: str
) -> None:
    """Fail unless ``warm`` loaded ``tokens`` tokens from storage alone and generated ``cold``'s.

    Both are ``/generate`` replies. ``warm`` must report ``tokens`` cached prompt tokens, all from
    the storage tier (none from the device or the host arena), and choose ``cold``'s tokens with
    bit-identical logprobs (:func:`assert_same_generation`).

    Raises:
        AssertionError: naming the cached tokens and where they came from, or the first
            differing step.
    """
    meta = warm["meta_info"]
    details = meta.get("cached_tokens_details")
    if meta.get("cached_tokens") != tokens or details != {
        "device": 0,
        "host": 0,
        "storage": tokens,
    }:
        msg = (
            f"{what}: {meta.get('cached_tokens')!r} cached tokens ({details!r}); "
            f"expected {tokens} from storage alone"
        )
        raise AssertionError(msg)
    assert_same_generation(Generation.from_reply(cold), Generation.from_reply(warm), what=what)
