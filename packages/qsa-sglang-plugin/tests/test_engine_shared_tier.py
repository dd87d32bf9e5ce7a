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

from qsa_hostcache import MooncakeAddress, MooncakeTier
from qsa_pytest.mooncake import MooncakeMaster, free_port
from qsa_pytest.processes import hang_guard_s, wait_until
from qsa_testing import (
    EngineConfig,
    EnginePool,
    GenerateRequest,
    Generation,
    assert_same_generation,
    assert_served_from_storage,
    tiny_qwen4_exp,
)
from qsa_testing.demo import DEMO_ENGINE

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
#: The demo's serving flags (the README's, scaled down): checkpoints where a 1,024-token prefill
#: chunk ends.
SERVER_ARGS = DEMO_ENGINE.server_args
ENGINE_A = EngineConfig(QWEN, switches=SWITCHES, server_args=SERVER_ARGS)
ENGINE_B = dataclasses.replace(ENGINE_A, replica=1)
CHUNK = int(SERVER_ARGS["chunked_prefill_size"])
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
        holder = MooncakeTier(MooncakeAddress.parse(master.address(segment_mb=256)))
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
    assert_served_from_storage(cold, warm, 2 * CHUNK, what="B from the store against A cold")
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


def _workers(base: str) -> dict[str, str]:
    """The router's workers, URL to id (``GET /workers``)."""
    with urllib.request.urlopen(f"{base}/workers", timeout=hang_guard_s()) as reply:
        listed = json.loads(reply.read())["workers"]
    return {worker["url"]: worker["id"] for worker in listed}


def _remove_worker(base: str, worker_id: str) -> None:
    """``DELETE /workers/{id}``: the operator drains a replica from the router."""
    request = urllib.request.Request(f"{base}/workers/{worker_id}", method="DELETE")
    with urllib.request.urlopen(request, timeout=hang_guard_s()) as reply:
        assert reply.status in (200, 202), reply.status


@pytest.mark.engine(ENGINE_B)
def test_a_turn_the_cache_aware_router_moves_to_the_other_replica_reuses_the_store(
    engines: EnginePool, store: Store, tmp_path: Path
) -> None:
    """Two live replicas behind ``sglang-router --policy cache_aware``: the second turn of a
    conversation stays on the replica that served the first (its arena answers); once the
    operator drains that replica from the router, the third turn lands on the other one and
    loads the conversation's checkpoints from the store."""
    engines.stop_running()  # this test runs its own two replicas at once
    store = store.running()
    keys = store.master.key_count()
    replicas = EnginePool(tmp_path / "replicas", max_live=2)
    router = None
    try:
        pair = {c.replica: replicas.engine(c) for c in (ENGINE_A, ENGINE_B)}
        port = free_port()
        with (tmp_path / "router.log").open("wb") as log:
            router = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--host=127.0.0.1",
                    f"--port={port}",
                    f"--prometheus-port={free_port()}",  # its default, 29000, may be taken
                    "--policy=cache_aware",
                    "--worker-urls",
                    *(engine.address for engine in pair.values()),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        base = f"http://127.0.0.1:{port}"
        wait_until("sglang-router to answer /health", lambda: _answers(f"{base}/health"))
        wait_until("sglang-router to list both replicas", lambda: len(_workers(base)) == 2)

        def turn(tokens: tuple[int, ...]) -> dict[str, Any]:
            return _post(f"{base}/generate", GenerateRequest(tokens, max_new_tokens=8).body())

        def lookups() -> dict[int, float]:
            name = "qsa_hisparse_prefix_cache_lookups_total"
            return {replica: engine.metric(name) for replica, engine in pair.items()}

        first_turn = QWEN.prompt(2100, seed=412)
        before = lookups()
        first = turn(first_turn)
        assert first["meta_info"]["cached_tokens"] == 0
        served = [r for r, n in lookups().items() if n > before[r]]
        assert len(served) == 1, f"lookups before {before}, after {lookups()}"
        home, other = served[0], 1 - served[0]

        # The second turn stays where the first was served: the arena answers, not the store.
        second_turn = (*first_turn, *first["output_ids"], *QWEN.prompt(1000, seed=413))
        before = lookups()
        second = turn(second_turn)
        assert lookups()[other] == before[other], "cache_aware moved the second turn"
        assert second["meta_info"]["cached_tokens"] == 2 * CHUNK
        assert second["meta_info"]["cached_tokens_details"]["host"] == 2 * CHUNK
        # Its checkpoints (1,024, 2,048 and 3,072 tokens; 3,108 is not a whole page) reach the
        # store: the first turn's two, then the second turn's one more.
        wait_until(
            "the conversation's checkpoints in the store",
            lambda: store.master.key_count() >= keys + 3,
        )

        # The operator drains the replica that served the conversation; the third turn lands
        # on the other one, whose arena never saw it, and loads 3,072 tokens from the store.
        _remove_worker(base, _workers(base)[pair[home].address])
        wait_until("the router to drop the drained replica", lambda: len(_workers(base)) == 1)
        third_turn = (*second_turn, *second["output_ids"], *QWEN.prompt(500, seed=414))
        before = lookups()
        third = turn(third_turn)
        assert lookups()[other] > before[other]
        assert third["meta_info"]["cached_tokens"] == 3 * CHUNK
        assert third["meta_info"]["cached_tokens_details"] == {
            "device": 0,
            "host": 0,
            "storage": 3 * CHUNK,
        }
    finally:
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait()
        replicas.stop_running()
