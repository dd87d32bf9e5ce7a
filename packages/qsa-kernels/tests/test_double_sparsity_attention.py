"""A GQA model's attention geometry read from its text config, and the configs refused by name."""

from __future__ import annotations

import pytest

from qsa_kernels.double_sparsity import AttentionGeometry, DSConfigError

LLAMA = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_size": 64,
}


def test_the_config_fields_are_the_geometry() -> None:
    """Every field given: read as it is."""
    assert AttentionGeometry.from_text_config(LLAMA) == AttentionGeometry(2, 4, 2, 16)


@pytest.mark.parametrize("absent", [None, "drop"])
def test_kv_heads_default_to_the_query_heads_and_head_dim_to_hidden_over_heads(
    absent: str | None,
) -> None:
    """Without (or with null) ``num_key_value_heads`` and ``head_dim``: MHA, hidden / heads."""
    fields = {"num_key_value_heads", "head_dim"}
    text: dict[str, object] = {k: v for k, v in LLAMA.items() if k not in fields}
    if absent is None:
        text = {**text, "num_key_value_heads": None, "head_dim": None}
    assert AttentionGeometry.from_text_config(text) == AttentionGeometry(2, 4, 4, 16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": None}, "num_hidden_layers=None is not supported"),
        ({"num_attention_heads": 0}, "num_attention_heads=0 is not supported"),
        ({"num_key_value_heads": True}, "num_key_value_heads=True is not supported"),
        ({"head_dim": 16.0}, "head_dim=16.0 is not supported"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads=3 .*a divisor of num_attention_heads=4"),
        (
            {"head_dim": None, "hidden_size": 66},
            r"hidden_size=66 .*a multiple of num_attention_heads=4, or an explicit head_dim",
        ),
        ({"head_dim": None, "hidden_size": "64"}, "hidden_size='64' is not supported"),
    ],
)
def test_a_field_that_is_no_positive_int_or_does_not_divide_is_refused_first_by_name(
    change: dict[str, object], message: str
) -> None:
    """The message starts with the field and its value (an engine prefixes where it came from)."""
    with pytest.raises(DSConfigError, match=f"^{message}"):
        AttentionGeometry.from_text_config({**LLAMA, **change})


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_attention_heads"])
def test_a_missing_required_field_is_named(field: str) -> None:
    """The two required fields missing: ``<field> is missing``."""
    text = {k: v for k, v in LLAMA.items() if k != field}
    with pytest.raises(DSConfigError, match=f"^{field} is missing"):
        AttentionGeometry.from_text_config(text)


def test_hidden_size_is_required_only_without_head_dim() -> None:
    """No ``head_dim``: ``hidden_size`` is needed to derive it."""
    text = {k: v for k, v in LLAMA.items() if k not in {"head_dim", "hidden_size"}}
    with pytest.raises(DSConfigError, match=r"^hidden_size is missing"):
        AttentionGeometry.from_text_config(text)
    assert AttentionGeometry.from_text_config({**text, "head_dim": 8}).head_dim == 8
