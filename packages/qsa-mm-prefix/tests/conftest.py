"""Shared builders: a Qwen-VL-like processor fingerprint and deterministic image content."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import settings

from qsa_mm_prefix import Modality, MultimodalItem, PreprocessArg, ProcessorFingerprint

# Wall-clock deadlines are meaningless on a shared 2-core CI machine; examples must still pass.
settings.register_profile("qsa", deadline=None)
settings.load_profile("qsa")

# Patch rows of a Qwen-VL pixel tensor: 3 channels x 2 temporal x 14 x 14.
PATCH_DIM = 1176
MERGE = 2

QWEN_ARGS: dict[str, PreprocessArg] = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": MERGE,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "resample": 3,
    "do_convert_rgb": True,
}


def pixels(seed: int, grid: tuple[int, int, int]) -> np.ndarray:
    """A float32 pixel tensor ``[t·h·w, 1176]`` with content fixed by ``seed``."""
    t, h, w = grid
    return np.random.default_rng(seed).standard_normal((t * h * w, PATCH_DIM)).astype(np.float32)


def image(start: int, grid: tuple[int, int, int], seed: int) -> MultimodalItem:
    """An image whose span length follows the Qwen-VL rule ``t·h·w / merge²``."""
    t, h, w = grid
    return MultimodalItem(
        Modality.IMAGE,
        start=start,
        length=t * h * w // MERGE**2,
        content=pixels(seed, grid),
        grid=grid,
    )


@pytest.fixture
def qwen_args() -> dict[str, PreprocessArg]:
    return dict(QWEN_ARGS)


@pytest.fixture
def processor() -> ProcessorFingerprint:
    return ProcessorFingerprint.create(
        "Qwen2VLImageProcessorFast", "transformers==4.57.1", QWEN_ARGS
    )


@pytest.fixture
def make_image() -> Callable[[int, tuple[int, int, int], int], MultimodalItem]:
    return image
