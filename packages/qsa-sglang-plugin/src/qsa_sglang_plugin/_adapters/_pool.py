"""SGLang's MHA K/V pool with one page of storage (the plugin holds the attention layers' K/V).

Imported only when SGLang resolves its pool class (the AFTER hook of :mod:`._kv_pool`).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from qsa_sglang_plugin._errors import OffloadRuntimeError

__all__ = ("NoRawKVPool",)


class NoRawKVPool(MHATokenToKVPool):
    """SGLang's MHA pool whose buffers hold only the padding page (slots without storage)."""

    def _create_buffers(self) -> None:
        size: int = self.size  # type: ignore[has-type]
        self.size = 0  # the buffers get the padding page only
        try:
            super()._create_buffers()
        finally:
            self.size = size

    def set_kv_buffer(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        msg = "the plugin holds the attention layers' K/V; nothing may write SGLang's K/V pool"
        raise OffloadRuntimeError(msg)

    def move_kv_cache(self, tgt_loc: Any, src_loc: Any) -> None:
        # The plugin's stores are addressed by rows or owned slots, which a move leaves behind.
        del tgt_loc, src_loc
        msg = (
            "the plugin holds the attention layers' K/V; SGLang's K/V pool cannot move "
            "slots (speculative decoding and pool compaction are not supported)"
        )
        raise OffloadRuntimeError(msg)
