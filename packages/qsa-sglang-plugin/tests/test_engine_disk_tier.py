"""The host prefix cache's disk tier in real SGLang 0.5.23 engines: checkpoints that outlive a
restart.

``SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE=file:///DIR`` writes every checkpoint an engine
publishes through to a file of ``DIR``. An engine started after the first one stopped (a replica
restarted, or another on the same host), its arena empty, serves the same prompt from those
files: the same ``cached_tokens`` as a warm run, reported as a ``storage`` hit, and the same answer
bit for bit. Engines run one at a time here (``QSA_TESTING_MAX_LIVE_ENGINES``, 1 by default).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from qsa_pytest.processes import wait_until
from qsa_testing import (
    EngineConfig,
    EnginePool,
    GenerateRequest,
    assert_served_from_storage,
    tiny_qwen4_exp,
)
from qsa_testing.demo import DEMO_ENGINE

QWEN = tiny_qwen4_exp()
#: The tier's directory, chosen when the module is imported: the engines' switches name it.
DIRECTORY = Path(tempfile.mkdtemp(prefix="qsa-disk-tier-"))
SWITCHES = {
    "SGLANG_QSA_MODEL_COMPAT": "1",
    "SGLANG_QSA_HISPARSE_V3": "p2-offload",
    "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "6",
    "SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE": f"file://{DIRECTORY}?max_mb=256",
}
SERVER_ARGS = DEMO_ENGINE.server_args
ENGINE = EngineConfig(QWEN, switches=SWITCHES, server_args=SERVER_ARGS)
RESTARTED = dataclasses.replace(ENGINE, replica=1)
CHUNK = int(SERVER_ARGS["chunked_prefill_size"])
#: Checkpointed at 1,024 and 2,048 tokens (the end, 3,000, is not a whole page): a hit covers
#: 2,048.
PROMPT = QWEN.prompt(3000, seed=420)


@pytest.fixture(scope="module", autouse=True)
def _directory() -> Iterator[Path]:
    yield DIRECTORY
    shutil.rmtree(DIRECTORY, ignore_errors=True)


def _objects() -> int:
    return len(list(DIRECTORY.glob("*/*.qsa")))


@pytest.mark.engine(ENGINE)
def test_a_restarted_engine_serves_the_checkpoints_its_predecessor_wrote_to_disk(
    engines: EnginePool,
) -> None:
    body = GenerateRequest(PROMPT, max_new_tokens=16).body()
    first = engines.engine(ENGINE)
    cold = first.post_json("/generate", body)
    assert cold["meta_info"]["cached_tokens"] == 0
    writes = "qsa_hisparse_prefix_cache_shared_writes_total"
    wait_until("two checkpoints written to disk", lambda: first.metric(writes, tier="disk") >= 2)
    assert _objects() == 2

    restarted = engines.engine(RESTARTED)  # another process; the first one stopped
    warm = restarted.post_json("/generate", body)

    assert_served_from_storage(
        cold, warm, 2 * CHUNK, what="the restarted engine from disk against the first one cold"
    )
    hits = restarted.metric("qsa_hisparse_prefix_cache_shared_hits_total", tier="disk")
    assert (hits, restarted.metric("qsa_hisparse_prefix_cache_shared_corrupt_total")) == (1, 0)
    salted = restarted.generate(GenerateRequest(PROMPT, max_new_tokens=16, cache_salt="other"))
    assert salted.cached_tokens == 0  # another salt shares nothing
