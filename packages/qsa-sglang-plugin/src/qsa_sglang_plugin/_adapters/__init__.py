"""Thin adapters from SGLang 0.5.23's objects to the QSA HiSparse libraries (pure functions).

Each function reads SGLang objects that already exist (``ServerArgs``, ``ModelConfig``,
``MultimodalInputs``) and returns a library value; none registers a hook or imports SGLang at
module import time.
"""

from qsa_sglang_plugin._adapters._multimodal import (
    mm_items_from_sglang,
    prompt_identity_from_sglang,
)
from qsa_sglang_plugin._adapters._namespace import (
    DIGEST_SERVER_FIELDS,
    cache_namespace_from_sglang,
    config_digest_from_sglang,
)
from qsa_sglang_plugin._adapters._pool_sizing import capacity_plan_from_sglang

__all__ = (
    "DIGEST_SERVER_FIELDS",
    "cache_namespace_from_sglang",
    "capacity_plan_from_sglang",
    "config_digest_from_sglang",
    "mm_items_from_sglang",
    "prompt_identity_from_sglang",
)
