"""Keys are the same in every process, whatever PYTHONHASHSEED is.

Run as a script, this module prints the scenario's keys as JSON; the test compares the output of
two interpreters started with different hash seeds against the keys computed in the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from qsa_mm_prefix import (
    ContentKind,
    Modality,
    MultimodalItem,
    ProcessorFingerprint,
    build_prompt_identity,
)
from qsa_pytest.processes import hang_guard_s


def scenario() -> dict[str, list[str]]:
    """Keys and page identities of a fixed prompt with three images of different kinds."""
    processor = ProcessorFingerprint.create(
        "Qwen2VLImageProcessorFast",
        "transformers==4.57.1",
        {
            "size": {"shortest_edge": 3136, "longest_edge": 12845056},
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "patch_size": 14,
            "merge_size": 2,
            "do_resize": True,
            "name_tag": "ünïcode",
        },
    )
    pixels = np.random.default_rng(1234).standard_normal((4 * 6, 1176)).astype(np.float32)
    items = [
        MultimodalItem(Modality.IMAGE, 60, 6, content=pixels, grid=(1, 4, 6)),
        MultimodalItem(
            Modality.IMAGE,
            66,
            100,
            content=bytes(range(256)) * 40,
            content_kind=ContentKind.ENCODED,
        ),
        MultimodalItem(
            Modality.IMAGE,
            300,
            9,
            content=pixels[:9],
            grid=(1, 6, 6),
            dtype="float32",
            shape=(9, 1176),
        ),
    ]
    identity = build_prompt_identity(400, items, processor=processor, page_size=64)
    return {
        "processor": [processor.digest.hex()],
        "images": [k.digest.hex() for k in identity.image_keys],
        "pages": [p.hex() for p in identity.page_identities],
    }


def test_identical_inputs_give_identical_keys_across_processes() -> None:
    """Two interpreters with different PYTHONHASHSEED produce the in-process keys byte for byte."""
    here = scenario()
    assert len(set(here["images"])) == 3
    # 400 tokens in 7 pages; images at [60, 66), [66, 166) and [300, 309).
    assert [i for i, p in enumerate(here["pages"]) if p] == [0, 1, 2, 4]
    for seed in ("0", "987654321"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, __file__],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=hang_guard_s(),
        )
        assert json.loads(done.stdout) == here


if __name__ == "__main__":
    print(json.dumps(scenario()))  # noqa: T201 (the test reads this output)
