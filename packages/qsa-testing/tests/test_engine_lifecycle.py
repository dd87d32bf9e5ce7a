"""A real engine starts, serves, refuses bad requests by name, and leaves no process behind."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from qsa_testing import (
    EngineConfig,
    EngineRequestError,
    EngineStartError,
    GenerateRequest,
    start_engine,
    tiny_llama,
)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _pids_working_in(directory: Path) -> list[int]:
    """Live processes whose working directory is ``directory`` (an engine's run in its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = (entry / "cwd").resolve(strict=True)
        except OSError:
            continue
        if cwd == directory.resolve():
            found.append(int(entry.name))
    return found


def test_engine_serves_a_request_and_close_stops_every_process(tmp_path: Path) -> None:
    model = tiny_llama()
    engine = start_engine(EngineConfig(model, plugin=False), tmp_path)
    try:
        assert engine.running
        assert engine.start_seconds > 0
        assert engine.process_group in _pids_working_in(tmp_path)
        request = GenerateRequest(model.prompt(40, seed=9), max_new_tokens=4, top_logprobs=3)
        generation = engine.generate(request)
        assert generation.prompt_tokens == 40
        assert len(generation.output_ids) == 4
        assert all(len(step) == 3 for step in generation.top_logprobs)
        assert engine.generate(request) == generation
        with pytest.raises(EngineRequestError, match=r"/no_such_route answered 404"):
            engine.get_json("/no_such_route")
    finally:
        engine.close()
    assert _group_gone(engine.process_group), "close() left a process of the group"
    assert _pids_working_in(tmp_path) == [], "close() left a process of the engine"
    assert "[qsa-testing] stand-in applied: dummy_weight_range" in engine.log_tail(10_000)


def test_a_server_that_cannot_start_reports_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    config = EngineConfig(tiny_llama(), plugin=False, server_args={"no_such_server_arg": 1})
    with pytest.raises(
        EngineStartError,
        match=r"(?s)exited with status 1 .*Unexpected keyword argument 'no_such_server_arg'",
    ):
        start_engine(config, tmp_path)
    assert (tmp_path / "server.log").is_file()
    assert _pids_working_in(tmp_path) == [], "a server process outlived the start"


def test_a_server_whose_port_was_taken_starts_again_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process binds the chosen port first: that server stops, the next one serves."""
    from qsa_testing import _engine

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        real = _engine._free_port
        monkeypatch.setattr(_engine, "_free_port", lambda: next(ports, None) or real())
        engine = start_engine(EngineConfig(tiny_llama(), plugin=False), tmp_path)
    try:
        assert not engine.address.endswith(f":{busy}")
        reply = engine.generate(GenerateRequest(tiny_llama().prompt(20, seed=1), max_new_tokens=2))
        assert len(reply.output_ids) == 2
    finally:
        engine.close()
    first = (tmp_path / "server-port-taken-1.log").read_text(encoding="utf-8", errors="replace")
    assert f"('127.0.0.1', {busy}): address already in use" in first
