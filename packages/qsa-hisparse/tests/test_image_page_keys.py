"""Image identities in host prefix keys: text pages key as without images, image pages apart.

The two libraries meet here as the SGLang plugin uses them: ``qsa_mm_prefix`` names what each
page's images are, and its :attr:`~qsa_mm_prefix.PromptIdentity.page_extras` go into a
``qsa_hostcache.PrefixKey``.
"""

from __future__ import annotations

import torch

from qsa_hostcache import CacheNamespace, HostPrefixCache, PrefixKey
from qsa_mm_prefix import (
    ContentKind,
    Modality,
    MultimodalItem,
    ProcessorFingerprint,
    build_prompt_identity,
)

PAGE = 64
NAMESPACE = CacheNamespace(model="m", dtype="bfloat16", tp_size=1, tp_rank=0, config_digest="d")
PROCESSOR = ProcessorFingerprint.create("qwen-vl-image", "1", {"min_pixels": 3136})


def _image_prompt(
    picture: bytes, *, text: int = 3 * PAGE, image: int = 256
) -> tuple[tuple[int, ...], dict[int, bytes]]:
    """``text`` text tokens, one image of ``image`` placeholder tokens, then a page of text."""
    tokens = tuple(range(10, 10 + text)) + (7,) * image + tuple(range(5000, 5000 + PAGE))
    item = MultimodalItem(
        modality=Modality.IMAGE,
        start=text,
        length=image,
        content=picture,
        content_kind=ContentKind.ENCODED,
        grid=(1, 32, 32),
    )
    identity = build_prompt_identity(len(tokens), [item], processor=PROCESSOR, page_size=PAGE)
    return tokens, identity.page_extras


def _publish(cache: HostPrefixCache, key: PrefixKey, pages: int) -> None:
    ticket = cache.publish(key.prefix(pages), {"state": torch.zeros(pages)})
    assert ticket is not None


def test_only_pages_an_image_overlaps_carry_an_identity() -> None:
    tokens, extras = _image_prompt(b"\x01" * 4096)
    assert sorted(extras) == [3, 4, 5, 6]  # the image's 256 tokens fill pages 3 to 6
    assert len(tokens) // PAGE == 8


def test_text_before_an_image_matches_the_same_text_without_it() -> None:
    cache = HostPrefixCache(4 << 20, block_bytes=4096)
    tokens, extras = _image_prompt(b"\x01" * 4096)
    text_only = PrefixKey(NAMESPACE, tokens[: 3 * PAGE], page_size=PAGE)
    _publish(cache, text_only, 3)
    with_image = PrefixKey(NAMESPACE, tokens, page_size=PAGE, page_extras=extras)
    match = cache.match(with_image)
    assert match is not None
    assert match.num_tokens == 3 * PAGE
    assert with_image.prefix(3).page_hashes() == text_only.page_hashes()


def test_a_text_prompt_never_matches_an_image_checkpoint() -> None:
    cache = HostPrefixCache(4 << 20, block_bytes=4096)
    tokens, extras = _image_prompt(b"\x01" * 4096)
    _publish(cache, PrefixKey(NAMESPACE, tokens, page_size=PAGE, page_extras=extras), 8)
    match = cache.match(PrefixKey(NAMESPACE, tokens, page_size=PAGE))  # same ids, no image
    assert match is None


def test_the_same_ids_with_another_image_share_only_the_text_before_it() -> None:
    cache = HostPrefixCache(4 << 20, block_bytes=4096)
    tokens, extras = _image_prompt(b"\x01" * 4096)
    _publish(cache, PrefixKey(NAMESPACE, tokens, page_size=PAGE, page_extras=extras).prefix(3), 3)
    _publish(cache, PrefixKey(NAMESPACE, tokens, page_size=PAGE, page_extras=extras), 8)
    same = cache.match(PrefixKey(NAMESPACE, tokens, page_size=PAGE, page_extras=extras))
    other_tokens, other_extras = _image_prompt(b"\x02" * 4096)
    assert other_tokens == tokens
    other = cache.match(PrefixKey(NAMESPACE, tokens, page_size=PAGE, page_extras=other_extras))
    assert same is not None
    assert same.num_tokens == 8 * PAGE
    assert other is not None
    assert other.num_tokens == 3 * PAGE
