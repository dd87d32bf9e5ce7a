"""What SGLang's PLE table constructor allocates, with the plugin's hooks on; prints a JSON report.

Usage: ``python ple_allocation_scenario.py <model_dir>`` with ``SGLANG_QSA_MODEL_COMPAT=1``. Runs in
a fresh process (it applies the hooks and publishes SGLang's process-wide runtime context): for
each PLE dtype (SGLang's bf16, the plugin's ``int8_row``) on the device and offloaded, it builds
the tiny model's real ``Qwen4ExpNGramEmbedding`` on CPU as SGLang's loader does (its text config,
``ple_offload_embedding`` set as ``load_model_utils`` sets it) while a torch dispatch mode records
every new storage an operator creates: bytes, dtype, device, and whether it was asked pinned (on a
machine without CUDA a pinned request is served from ordinary host memory, and still recorded as
pinned). The last stdout line is the JSON report.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationLog(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every storage an operator's outputs hold that none of its inputs held (meta excluded)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.storages: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        pinned = bool(kwargs.get("pin_memory")) or func.overloadpacket in (
            torch.ops.aten._pin_memory,
            torch.ops.aten.pin_memory,
        )
        if kwargs.get("pin_memory") and not torch.cuda.is_available():
            kwargs["pin_memory"] = False
        if func.overloadpacket is torch.ops.aten._pin_memory and not torch.cuda.is_available():
            out = args[0].clone()
        else:
            out = func(*args, **kwargs)
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if _is_real(t)}
        for tensor in tree_flatten(out)[0]:
            if _is_real(tensor) and _storage(tensor) not in inputs:
                inputs.add(_storage(tensor))
                self.storages.append(
                    {
                        "nbytes": tensor.untyped_storage().nbytes(),
                        "dtype": str(tensor.dtype),
                        "device": tensor.device.type,
                        "pinned": pinned,
                    }
                )
        return out


def _is_real(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "meta"


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def main(model_dir: str) -> dict[str, Any]:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.qwen4_exp import Qwen4ExpNGramEmbedding
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    args = ["--model-path", model_dir, "--device", "cpu", "--disable-radix-cache"]
    server_args = prepare_server_args(args)
    server_args.resolve_once()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    text_config = ModelConfig.from_server_args(server_args).hf_text_config
    report: dict[str, Any] = {}
    for dtype in (None, "int8_row"):
        for offload in (False, True):
            config = copy.copy(text_config)
            config.ple_embedding_dtype = dtype
            config.ple_offload_embedding = offload
            config.ple_offload_backend = "pinned"
            log = AllocationLog()
            with torch.device("cpu"), log:
                module = Qwen4ExpNGramEmbedding(config, config.ple_embed_dim, prefix="ple")
            table = module.ngram_embedding
            report[f"{dtype or 'bf16'}/{'offload' if offload else 'device'}"] = {
                "storages": log.storages,
                "table_class": type(table).__name__,
                "rows": int(table.num_embeddings_per_partition),
                "dim": int(table.embedding_dim),
                "config_is_callers": module.config is config,
            }
    return report


if __name__ == "__main__":
    result = main(sys.argv[1])
    sys.stdout.write("\n" + json.dumps(result) + "\n")
