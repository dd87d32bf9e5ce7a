"""A serving engine's requests as prefix keys: each request's page extras decided once."""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Callable, Hashable, Mapping, Sized
from typing import Generic, TypeVar

from qsa_hostcache._errors import InvalidKeyError
from qsa_hostcache._keys import CacheNamespace, PrefixKey

__all__ = ("PromptKeys",)

logger = logging.getLogger(__name__)

R = TypeVar("R")


class PromptKeys(Generic[R]):
    """Prefix keys of an engine's requests (``R``), each request's page extras computed once.

    ``extras(request)`` gives the page extras of the request's whole prompt (``page ->
    identity``, e.g. its images' identities) or why the request cannot be keyed (an enum member,
    e.g. a ``qsa_mm_prefix.BypassReason``). It is called at the request's first :meth:`key` or
    :meth:`bypass` (its media may be gone later) and the answer is kept as long as the request
    object lives (weakly). A request that cannot be keyed is logged once and told to
    ``on_bypass`` once (a metric, say).

    Args:
        page_size: tokens per page of the cache.
        extras: a request's page extras, or its bypass reason.
        request_id: the request's name in logs.
        on_bypass: called once per request that cannot be keyed, with its reason.
    """

    def __init__(
        self,
        page_size: int,
        extras: Callable[[R], Mapping[int, bytes] | enum.Enum],
        *,
        request_id: Callable[[R], Hashable] = id,
        on_bypass: Callable[[R, enum.Enum], None] | None = None,
    ) -> None:
        self.page_size = page_size
        self._extras = extras
        self._request_id = request_id
        self._on_bypass = on_bypass
        self._known: weakref.WeakKeyDictionary[R, Mapping[int, bytes] | enum.Enum] = (
            weakref.WeakKeyDictionary()
        )

    def bypass(self, request: R) -> enum.Enum | None:
        """Why ``request`` cannot be keyed, or ``None`` when it can."""
        known = self._of(request)
        return None if isinstance(known, Mapping) else known

    def key(self, request: R, tokens: Sized, namespace: CacheNamespace) -> PrefixKey:
        """The key of ``tokens`` (``request``'s first token ids) in ``namespace``.

        The pages ``tokens`` covers carry their extras.

        Raises:
            InvalidKeyError: ``request`` cannot be keyed (:meth:`bypass`).
        """
        known = self._of(request)
        if not isinstance(known, Mapping):
            msg = (
                f"request {self._request_id(request)!r} is not keyed ({known.value}); "
                "it has no prefix key"
            )
            raise InvalidKeyError(msg)
        pages = -(-len(tokens) // self.page_size)
        extras = {page: extra for page, extra in known.items() if page < pages}
        return PrefixKey(namespace, tokens, page_size=self.page_size, page_extras=extras)

    def _of(self, request: R) -> Mapping[int, bytes] | enum.Enum:
        known = self._known.get(request)
        if known is None:
            known = self._known[request] = self._extras(request)
            if not isinstance(known, Mapping):
                if self._on_bypass is not None:
                    self._on_bypass(request, known)
                logger.info(
                    "prefix cache: %r is not reused (%s)", self._request_id(request), known.value
                )
        return known
