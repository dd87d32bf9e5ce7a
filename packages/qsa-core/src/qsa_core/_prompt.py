"""What a prompt must be before it reaches a QSA model: at least one token, each in the vocabulary.

An empty prompt, or a token id outside ``[0, vocab_size)``, reaches SGLang 0.5.23's scheduler
unchecked when it comes as ids (or as text that tokenizes to nothing), and its forward pass then
fails (QSA's write plan indexes the prompt's last token; an embedding lookup reads outside its
table), which stops the scheduler and with it the server. :func:`check_prompt` refuses such a
prompt with a :class:`PromptError` (a ``ValueError``, which SGLang answers with HTTP 400) naming
the first bad value and the allowed ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from qsa_core._errors import PromptError

__all__ = ("check_prompt",)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prompt(input_ids: Sequence[int], vocab_size: int) -> None:
    """Refuse an empty prompt or a token id outside ``[0, vocab_size)``.

    Args:
        input_ids: the prompt's token ids, as the server will prefill them.
        vocab_size: the model's vocabulary size (ids ``0`` to ``vocab_size - 1``).

    Raises:
        PromptError: no token, an id that is not an integer, or one outside the vocabulary (the
            message names the position, the value and the allowed range); or arguments of the
            wrong kind.
    """
    if not _is_int(vocab_size) or vocab_size < 1:
        msg = f"vocab_size={vocab_size!r} is not allowed; allowed: an integer of 1 or more"
        raise PromptError(msg)
    if isinstance(input_ids, str | bytes) or not isinstance(input_ids, Sequence):
        msg = (
            f"the prompt is {input_ids!r} ({type(input_ids).__name__}); "
            "allowed: a sequence of token ids"
        )
        raise PromptError(msg)
    if not input_ids:
        msg = f"the prompt has 0 tokens ({input_ids!r}); allowed: 1 token or more"
        raise PromptError(msg)
    for position, token in enumerate(input_ids):
        if not _is_int(token):
            msg = (
                f"prompt token {position} is {token!r} ({type(token).__name__}); "
                f"allowed: an integer id in [0, {vocab_size})"
            )
            raise PromptError(msg)
        if not 0 <= token < vocab_size:
            msg = (
                f"prompt token {position} has id {token}, outside the model's vocabulary; "
                f"allowed: [0, {vocab_size})"
            )
            raise PromptError(msg)
