"""The attention geometry double sparsity needs, read from an ordinary GQA model's text config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from qsa_kernels.double_sparsity._errors import DSConfigError

__all__ = ("AttentionGeometry",)

#: Why the fields are read, in every refusal.
_WHY = "double sparsity needs the attention geometry"


def _refuse(field: str, value: object, supported: str, why: str) -> DSConfigError:
    return DSConfigError(f"{field}={value!r} is not supported ({why}); supported: {supported}")


def _optional(text_config: Mapping[str, object], field: str) -> int | None:
    """A positive int field of the config; None when absent or null."""
    value = text_config.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(field, value, "a positive integer", _WHY)
    return value


def _required(text_config: Mapping[str, object], field: str) -> int:
    """A positive int field the config must have."""
    if field not in text_config:
        msg = f"{field} is missing ({_WHY}); supported: a positive integer"
        raise DSConfigError(msg)
    value = _optional(text_config, field)
    if value is None:  # present as null
        raise _refuse(field, value, "a positive integer", _WHY)
    return value


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    """An ordinary GQA model's attention, as the channel file and the label cache see it.

    Attributes:
        layers: attention layers ``L`` (``num_hidden_layers``).
        q_heads: query heads (``num_attention_heads``).
        kv_heads: KV heads ``Hkv`` (``num_key_value_heads``; default: the query heads).
        head_dim: ``D`` (``head_dim``; default: ``hidden_size`` over the query heads).
    """

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_text_config(cls, text_config: Mapping[str, object]) -> AttentionGeometry:
        """Read the geometry of an HF-style text config.

        ``num_hidden_layers`` and ``num_attention_heads`` are required;
        ``num_key_value_heads`` defaults to the query heads and must divide them; ``head_dim``
        defaults to ``hidden_size`` over the query heads, which must divide it.

        Raises:
            DSConfigError: a field missing, not a positive integer, or not dividing as above;
                the message starts with the field's name and says its value and what is
                supported.
        """
        layers = _required(text_config, "num_hidden_layers")
        heads = _required(text_config, "num_attention_heads")
        kv_heads = _optional(text_config, "num_key_value_heads") or heads
        head_dim = _optional(text_config, "head_dim")
        if heads % kv_heads:
            raise _refuse(
                "num_key_value_heads",
                kv_heads,
                f"a divisor of num_attention_heads={heads}",
                "each KV head serves a whole group of query heads",
            )
        if head_dim is None:
            hidden = _required(text_config, "hidden_size")
            if hidden % heads:
                raise _refuse(
                    "hidden_size",
                    hidden,
                    f"a multiple of num_attention_heads={heads}, or an explicit head_dim",
                    "without head_dim the head dim is hidden_size / num_attention_heads",
                )
            head_dim = hidden // heads
        return cls(layers, heads, kv_heads, head_dim)
