"""GPTQ / AutoRound routed experts on Marlin under a bf16 model (docs/model-compat.md).

SGLang 0.5.23's ``GPTQMarlinMoEScheme.create_weights`` makes the experts' ``w13_scales`` and
``w2_scales`` fp16 whatever the model's dtype, and its Marlin MoE GEMM requires the scales in the
activations' dtype: a GPTQ MoE checkpoint loads under ``--dtype bfloat16`` and the first request
stops in ``fused_marlin_moe``. The AFTER hook below makes both parameters again in the model's
dtype, as SGLang's GPTQ Marlin linear method and vLLM's GPTQ Marlin MoE method do, so that the
loader's copy converts the checkpoint's fp16 scales; Marlin's scale permutation after loading
keeps their dtype.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Final

import torch

__all__ = ("after_gptq_marlin_moe_create_weights", "marlin_moe_scales_dtype")

logger = logging.getLogger(__name__)

#: The activation dtypes the Marlin MoE GEMM is built for; its scales must be the same.
MARLIN_ACTIVATION_DTYPES: Final = (torch.float16, torch.bfloat16)
#: The scale parameters ``GPTQMarlinMoEScheme.create_weights`` makes in fp16.
SCALES: Final = ("w13_scales", "w2_scales")

#: The dtypes this process logged the note for: once, not per layer (AutoRound builds a
#: quantization config per layer, so there is no per-model object to key on; a process serves one
#: model).
_LOGGED: set[torch.dtype] = set()


def marlin_moe_scales_dtype(params_dtype: torch.dtype) -> torch.dtype:
    """The dtype a Marlin MoE layer's scales take: the model's, where Marlin runs in it.

    The Marlin MoE GEMM multiplies in the activations' dtype (the model's) and requires its
    scales in it; for a dtype Marlin has no kernel for, upstream's fp16.
    """
    return params_dtype if params_dtype in MARLIN_ACTIVATION_DTYPES else torch.float16


def after_gptq_marlin_moe_create_weights(
    result: None, scheme: Any, *args: Any, **kwargs: Any
) -> None:
    """AFTER ``GPTQMarlinMoEScheme.create_weights``: the experts' scales in the model's dtype.

    Each of ``w13_scales`` and ``w2_scales`` is registered again, same shape and device, with the
    attributes the original carries (its weight loader, ``quant_method``, ``load_full_w2``...).
    Nothing changes where the dtype is upstream's fp16.
    """
    del result
    # The call's own arguments, by name, however it passed them.
    call = inspect.signature(type(scheme).create_weights).bind_partial(scheme, *args, **kwargs)
    layer, dtype = call.arguments["layer"], marlin_moe_scales_dtype(call.arguments["params_dtype"])
    changed = False
    for name in SCALES:
        old: torch.nn.Parameter = getattr(layer, name)
        if old.dtype == dtype:
            continue
        from sglang.srt.layers.linear import set_weight_attrs

        new = torch.nn.Parameter(torch.empty_like(old, dtype=dtype), requires_grad=False)
        set_weight_attrs(new, dict(vars(old)))
        layer.register_parameter(name, new)
        changed = True
    if changed and dtype not in _LOGGED:
        _LOGGED.add(dtype)
        logger.info(
            "GPTQ Marlin MoE: the experts' scales are held in the model dtype %s (upstream "
            "makes them fp16, which its Marlin MoE kernel refuses); the checkpoint's fp16 "
            "scales are converted at load, fp16 to bf16 rounding each to bf16's 8-bit mantissa",
            str(dtype).removeprefix("torch."),
        )
