"""The host prefix cache's shared tier in real SGLang 0.5.23 engines, over a real Mooncake Store.

``SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE=mooncake://...`` makes every checkpoint an engine
publishes an object of the store too. Another engine, its own arena empty, then serves the same
prompt from it: the same ``cached_tokens`` as a warm run of the first engine, reported as a
``storage`` hit, and the same answer bit for bit. The store keeps the objects in memory lent by a
client of the test process (the engines lend none), so they outlive the engine that wrote them:
engines run one at a time here (``QSA_TESTING_MAX_LIVE_ENGINES``, 1 by default), and the second
engine starts after the first stopped, as a replica restarted or added would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from qsa_hostcache import MooncakeTier, StoreAddress
from qsa_pytest.mooncake import MooncakeMaster, free_port
from qsa_pytest.processes import hang_guard_s, wait_until
from qsa_testing import (
    EngineConfig,
    EnginePool,
    GenerateRequest,
    Generation,
    assert_same_generation,
    tiny_qwen4_exp,
)

QWEN = tiny_qwen4_exp()
#: The master's RPC port, chosen when the module is imported: the engines' switches name it.
MASTER_PORT = free_port()
#: The engines lend no memory to the store (``segment_mb=0``): the test's own client does.
SWITCHES = {
    "SGLANG_QSA_MODEL_COMPAT": "1",
    "SGLANG_QSA_HISPARSE_V3": "p2-offload",
    "SGLANG_QSA_HISPARSE_PREFIX_CACHE_MB": "6",
    "SGLANG_QSA_HISPARSE_PREFIX_CACHE_STORE": f"mooncake://127.0.0.1:{MASTER_PORT}?segment_mb=0",
}
#: As the prefix-cache engine of ``test_engine_offload.py``: checkpoints where a 1,024-token
#: prefill chunk ends.
SERVER_ARGS = {
    "radix_cache_backend": "qsa_hisparse",
    "disable_overlap_schedule": True,
    "enable_metrics": True,
    "enable_cache_report": True,
    "max_running_requests": 4,
    "prefill_max_requests": 2,
    "chunked_prefill_size": 1024,
    "context_length": 8192,
    "cuda_graph_backend_prefill": "disabled",
}
ENGINE_A = EngineConfig(QWEN, switches=SWITCHES, server_args=SERVER_ARGS)
ENGINE_B = dataclasses.replace(ENGINE_A, replica=1)
CHUNK = 1024
#: Its prompt is checkpointed at 1,024 and 2,048 tokens (the end, 3,000, is not a whole page):
#: a hit covers 2,048.
PROMPT = QWEN.prompt(3000, seed=410)


class Store:
    """The master on :data:`MASTER_PORT` and the test's client that lends the store its memory.

    A test that kills the master leaves the next one to start another (:meth:`running`).
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._starts = 0
        self.master, self.holder = self._start()

    def _start(self) -> tuple[MooncakeMaster, MooncakeTier]:
        self._starts += 1
        log = self._directory / f"master-{self._starts}.log"
        master = MooncakeMaster(log, port=MASTER_PORT)
        holder = MooncakeTier(StoreAddress.parse(master.address(segment_mb=256)))
        assert holder.wait_connected(hang_guard_s()), f"the holder did not join; see {log}"
        return master, holder

    def running(self) -> Store:
        """This store, its master started again (and a new holder) if it was killed."""
        if self.master.process.poll() is not None:
            self.holder.close()
            self.master, self.holder = self._start()
        return self

    def close(self) -> None:
        self.holder.close()
        self.master.kill()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    made = Store(tmp_path_factory.mktemp("mooncake"))
    try:
        yield made
    finally:
        made.close()


@pytest.mark.engine(ENGINE_A)
def test_a_second_engine_serves_the_first_engines_checkpoint_from_the_store(
    engines: EnginePool, store: Store
) -> None:
    store = store.running()
    keys = store.master.key_count()
    body = GenerateRequest(PROMPT, max_new_tokens=16).body()
    # Engine A computes the prompt; its checkpoints at 1,024 and 2,048 tokens reach the store.
    engine_a = engines.engine(ENGINE_A)
    cold = engine_a.post_json("/generate", body)
    assert cold["meta_info"]["cached_tokens"] == 0
    wait_until(
        "engine A's two checkpoints in the store", lambda: store.master.key_count() >= keys + 2
    )

    # Engine B (another process, its arena empty; A stopped) serves it from the store.
    engine_b = engines.engine(ENGINE_B)
    warm = engine_b.post_json("/generate", body)
    assert warm["meta_info"]["cached_tokens"] == 2 * CHUNK
    assert warm["meta_info"]["cached_tokens_details"] == {
        "device": 0,
        "host": 0,
        "storage": 2 * CHUNK,
    }
    assert_same_generation(
        Generation.from_reply(cold),
        Generation.from_reply(warm),
        what="B from the store against A cold",
    )
    hits = engine_b.metric("qsa_hisparse_prefix_cache_shared_hits_total", tier="mooncake")
    hit_tokens = engine_b.metric("qsa_hisparse_prefix_cache_shared_hit_tokens_total")
    assert (hits, hit_tokens) == (1, 2 * CHUNK)
    assert engine_b.metric("qsa_hisparse_prefix_cache_shared_corrupt_total") == 0

    # Another cache_salt shares nothing, in the arena or in the store.
    salted = engine_b.generate(GenerateRequest(PROMPT, max_new_tokens=16, cache_salt="other"))
    assert salted.cached_tokens == 0
    assert salted.output_ids == Generation.from_reply(cold).output_ids

    # The master goes away: B still serves, from its arena (the checkpoint was copied there)
    # and computing what it lacks; every store call is a counted miss.
    store.master.kill()
    again = engine_b.post_json("/generate", body)
    assert again["meta_info"]["cached_tokens"] == 2 * CHUNK
    assert again["output_ids"] == cold["output_ids"]
    other = engine_b.generate(GenerateRequest(QWEN.prompt(2100, seed=411), max_new_tokens=8))
    assert other.cached_tokens == 0
    errors = engine_b.metric("qsa_hisparse_prefix_cache_shared_errors_total")
    unavailable = engine_b.metric("qsa_hisparse_prefix_cache_shared_unavailable_total")
    assert errors + unavailable >= 1

    # And A, started again with the master gone, computes the prompt and answers alike.
    engine_a = engines.engine(ENGINE_A)
    restarted = engine_a.post_json("/generate", body)
    assert restarted["meta_info"]["cached_tokens"] == 0
    assert_same_generation(
        Generation.from_reply(cold), Generation.from_reply(restarted), what="A again, store down"
    )


# ---- two replicas behind sglang-router ---------------------------------------------------


def _post(url: str, body: Mapping[str, object]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=hang_guard_s()) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@pytest.mark.engine(ENGINE_B)
def test_a_turn_routed_to_the_other_replica_reuses_the_first_turn_through_the_store(
    engines: EnginePool, store: Store, tmp_path: Path
) -> None:
    """Two live replicas behind ``sglang-router --policy round_robin``: consecutive turns of one
    conversation land on different replicas, and the second reuses the first's checkpoints."""
    engines.stop_running()  # this test runs its own two replicas at once
    store = store.running()
    keys = store.master.key_count()
    replicas = EnginePool(tmp_path / "replicas", max_live=2)
    router = None
    try:
        urls = [replicas.engine(c).address for c in (ENGINE_A, ENGINE_B)]
        port = free_port()
        with (tmp_path / "router.log").open("wb") as log:
            router = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--host=127.0.0.1",
                    f"--port={port}",
                    "--policy=round_robin",
                    "--worker-urls",
                    *urls,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        base = f"http://127.0.0.1:{port}"
        wait_until("sglang-router to answer /health", lambda: _answers(f"{base}/health"))

        first_turn = QWEN.prompt(2100, seed=412)
        first = _post(f"{base}/generate", GenerateRequest(first_turn, max_new_tokens=8).body())
        assert first["meta_info"]["cached_tokens"] == 0
        wait_until(
            "the first turn's checkpoints in the store",
            lambda: store.master.key_count() >= keys + 2,
        )
        second_turn = (*first_turn, *first["output_ids"], *QWEN.prompt(1000, seed=413))
        second = _post(f"{base}/generate", GenerateRequest(second_turn, max_new_tokens=8).body())
        # The other replica (round robin): its arena never saw the first turn; the store did.
        assert second["meta_info"]["cached_tokens"] == 2 * CHUNK
        assert second["meta_info"]["cached_tokens_details"]["storage"] == 2 * CHUNK
    finally:
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait()
        replicas.stop_running()
