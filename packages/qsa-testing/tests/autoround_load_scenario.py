"""Loads a checkpoint into SGLang 0.5.23's own Qwen4Exp model on the CPU; prints a JSON report.

Usage: ``python autoround_load_scenario.py <checkpoint_dir> <bf16|cuda-choice>``. Runs in a fresh
process (:func:`qsa_testing.load_into_sglang_qwen4_exp` publishes SGLang's process-wide runtime
context and a one-rank gloo group). The report names the parameters ``load_weights`` did not load
(``missing``), the checkpoint tensors it found no parameter for (its ``not found`` warnings:
``unexpected``), and the quantization method each layer got (``methods``: prefix to class name).
``cuda-choice`` is the model SGLang builds for an SM90 device (:class:`qsa_testing.LoadMode`).
The last stdout line is the JSON report.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from qsa_testing import load_into_sglang_qwen4_exp


def main(checkpoint: str, mode: str) -> dict[str, Any]:
    return load_into_sglang_qwen4_exp(checkpoint, mode).report()


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2])
    sys.stdout.write("\n" + json.dumps(result) + "\n")
