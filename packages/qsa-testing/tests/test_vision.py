"""The tiny Qwen4Exp that takes images: its tokenizer and processor, loaded as SGLang loads them."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

import pytest

from qsa_testing import ModelSpecError, tiny_image, tiny_qwen4_exp

VL = tiny_qwen4_exp(vision=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return VL.write(tmp_path_factory.mktemp("vl"))


def test_any_ordinary_ids_survive_decoding_and_encoding_again(model_dir: Path) -> None:
    """SGLang decodes a request's ids to text and its processor encodes them again."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    every = list(range(3, VL.prompt_token_limit))
    rng = random.Random(0)
    shuffled = [rng.randrange(3, VL.prompt_token_limit) for _ in range(4000)]
    for ids in (every, shuffled, [*every[:9], *VL.image_placeholder, *every[9:20]]):
        assert tokenizer(tokenizer.decode(ids))["input_ids"] == ids


def test_the_processor_expands_the_placeholder_into_one_pad_per_merged_patch(
    model_dir: Path,
) -> None:
    from PIL import Image
    from sglang.srt.utils.hf_transformers_utils import get_processor

    processor = get_processor(str(model_dir))
    start, pad, end = VL.image_placeholder
    text = processor.tokenizer.decode([7, start, pad, end, 8])
    picture = Image.open(io.BytesIO(base64.b64decode(tiny_image(1).split(",", 1)[1])))
    out = processor(text=[text], images=[picture], return_tensors="pt")
    pads = [pad] * VL.image_tokens(64, 64)
    assert out["input_ids"][0].tolist() == [7, start, *pads, end, 8]
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_pictures_are_seeded_and_distinct() -> None:
    assert tiny_image(1) == tiny_image(1)
    assert tiny_image(1) != tiny_image(2)
    assert tiny_image(3).startswith("data:image/png;base64,")


def test_image_sizes_off_the_merged_patch_grid_are_refused() -> None:
    assert VL.image_tokens(64, 128) == 8
    with pytest.raises(ModelSpecError, match="48 x 64 image is not allowed"):
        VL.image_tokens(48, 64)


def test_a_text_model_has_no_image_placeholder() -> None:
    assert tiny_qwen4_exp() != VL
    with pytest.raises(ModelSpecError, match="takes no images"):
        _ = tiny_qwen4_exp().image_placeholder
    with pytest.raises(ModelSpecError, match="takes no images"):
        tiny_qwen4_exp().image_tokens(64, 64)
