"""The maintainer's production command (docs/plugin.md, "The production command"), as data.

The command serves Qwen3.8-Flash-Next W4A16 AutoRound with an INT8-row PLE table at TP2, with
offload and the host prefix cache. Its flags here leave out ``--model-path``; the seed (the flags
as the maintainer gave them) and the two flags the plugin needs beside them are kept apart, since
start-up refuses the seed alone.
"""

from __future__ import annotations

import shlex
import types
from collections.abc import Mapping
from typing import Final

__all__ = ("PRODUCTION_FLAGS", "PRODUCTION_PLUGIN_FLAGS", "PRODUCTION_SWITCHES")

#: The environment the command starts under: the plugin's switches and its entry point.
PRODUCTION_SWITCHES: Final[Mapping[str, str]] = types.MappingProxyType(
    {
        "SGLANG_QSA_MODEL_COMPAT": "1",
        "SGLANG_QSA_HISPARSE_V3": "p2-offload",
        "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "32768",
        "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MAX_ENTRIES": "256",
        "SGLANG_PLUGINS": "qsa_hisparse",
    }
)
#: The seed's flags, without ``--model-path``.
PRODUCTION_FLAGS: Final[tuple[str, ...]] = tuple(
    shlex.split(
        """
        --model-impl sglang --dtype bfloat16 --tp-size 2
        --ple-offload-embedding
        --json-model-override-args '{"text_config":{"ple_embedding_dtype":"int8_row"}}'
        --kv-cache-dtype fp8_e4m3 --page-size 64 --context-length 262144
        --linear-attn-backend triton --mamba-ssm-dtype float32
        --mamba-radix-cache-strategy extra_buffer --mamba-track-interval 64
        --max-mamba-cache-size 40
        --mem-fraction-static 0.96 --max-running-requests 8 --max-total-tokens 2097152
        --chunked-prefill-size 2048 --prefill-decode-interval 1
        --disable-radix-cache --disable-overlap-schedule
        --cuda-graph-backend-decode full --cuda-graph-backend-prefill disabled
        --disable-cuda-graph-padding --cuda-graph-max-bs-decode 8
        --cuda-graph-bs-decode 1 2 3 4 5 6 7 8
        --image-processor-backend pil --mm-preprocess-cache-size-mb 2048
        --reasoning-parser qwen3 --tool-call-parser qwen3_coder --enable-cache-report
        """
    )
)
#: What the plugin needs beside the seed's flags (docs/plugin.md says why), one flag and its
#: value each, in the order start-up refuses their absence: the radix-cache backend (unset in
#: the seed: SGLang's own tree cache), then the prefill request limit (unset: no limit).
PRODUCTION_PLUGIN_FLAGS: Final[tuple[tuple[str, str], ...]] = (
    ("--radix-cache-backend", "qsa_hisparse"),
    ("--prefill-max-requests", "1"),
)
