"""A prompt the model cannot serve is refused at the front end, not by a dead scheduler.

SGLang 0.5.23 passes an empty prompt or out-of-vocabulary ids to the scheduler, whose forward
pass then fails. A BEFORE hook on ``TokenizerManager._validate_one_request`` applies
:func:`qsa_core.check_prompt`; its ``ValueError`` is answered with HTTP 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qsa_core import check_prompt

__all__ = ("before_validate_one_request",)


def before_validate_one_request(
    manager: Any, obj: Any, input_ids: Sequence[int] | None = None, *args: object, **kwargs: object
) -> None:
    """BEFORE hook on ``TokenizerManager._validate_one_request(obj, input_ids)``.

    Raises:
        qsa_core.PromptError: no token, or an id outside ``[0, vocab_size)``. A request by
            embeddings (``input_ids`` None) is SGLang's to check.
    """
    del obj, args, kwargs
    if input_ids is None:
        return
    check_prompt(input_ids, int(manager.model_config.vocab_size))
