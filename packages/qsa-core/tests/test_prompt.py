"""A prompt reaches the model only with at least one token, each inside the vocabulary."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qsa_core import PromptError, check_prompt

VOCAB = 1000


@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=64))
def test_a_prompt_of_in_vocabulary_ids_passes(ids: list[int]) -> None:
    check_prompt(ids, VOCAB)
    check_prompt(tuple(ids), VOCAB)


def test_an_empty_prompt_is_refused_naming_the_minimum() -> None:
    named = r"the prompt has 0 tokens \(\[\]\); allowed: 1 token or more"
    with pytest.raises(PromptError, match=named):
        check_prompt([], VOCAB)


@given(
    st.lists(st.integers(0, VOCAB - 1), max_size=8),
    st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB)),
    st.lists(st.integers(0, VOCAB - 1), max_size=8),
)
def test_the_first_id_outside_the_vocabulary_is_named_with_its_position(
    before: list[int], bad: int, after: list[int]
) -> None:
    with pytest.raises(PromptError) as caught:
        check_prompt([*before, bad, *after], VOCAB)
    assert f"prompt token {len(before)} has id {bad}" in str(caught.value)
    assert f"allowed: [0, {VOCAB})" in str(caught.value)


@pytest.mark.parametrize("bad", [1.0, "7", None, True, [3]])
def test_an_id_that_is_not_an_integer_is_refused_by_its_type(bad: object) -> None:
    with pytest.raises(PromptError, match=type(bad).__name__):
        check_prompt([1, bad], VOCAB)  # type: ignore[list-item]


def test_the_refusal_is_a_value_error_which_sglang_answers_with_http_400() -> None:
    assert issubclass(PromptError, ValueError)
