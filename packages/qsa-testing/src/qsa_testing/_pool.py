"""Engines shared by a whole test session: each configuration starts once, results are kept.

Starting an engine costs one to three minutes on two cores, and a tiny engine holds about 4 GiB of
host memory, so the pool keeps at most ``max_live`` engines running (one by default) and
remembers every generation it has served. A test that compares a configuration against upstream
therefore never needs both engines at once: the upstream results are looked up, not recomputed.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from qsa_testing._engine import Engine, EngineConfig, GenerateRequest, Generation, start_engine
from qsa_testing._errors import EngineConfigError

__all__ = ("ENV_MAX_LIVE_ENGINES", "EnginePool", "EngineStart")

#: Overrides how many engines a pool keeps running at once.
ENV_MAX_LIVE_ENGINES: Final = "QSA_TESTING_MAX_LIVE_ENGINES"
_logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStart:
    """One engine start, for the session's cost report.

    Attributes:
        label: the configuration's label.
        seconds: wall time from spawning the server to its first healthy answer.
        log_path: the server's log.
    """

    label: str
    seconds: float
    log_path: Path


class EnginePool:
    """Engines keyed by configuration, started on first use, stopped least recently used first."""

    def __init__(self, workdir: Path, *, max_live: int | None = None) -> None:
        if max_live is None:
            raw = os.environ.get(ENV_MAX_LIVE_ENGINES, "1")
            max_live = int(raw) if raw.isdigit() else 0
        if max_live < 1:
            msg = f"max_live={max_live!r} is not allowed; it must be a positive integer"
            raise EngineConfigError(msg)
        self._workdir = workdir
        self._max_live = max_live
        self._live: OrderedDict[EngineConfig, Engine] = OrderedDict()
        self._results: dict[tuple[EngineConfig, GenerateRequest], Generation] = {}
        self._together: dict[
            tuple[EngineConfig, tuple[GenerateRequest, ...]], tuple[Generation, ...]
        ] = {}
        self.starts: list[EngineStart] = []
        self.last_used: Engine | None = None
        self._latest: dict[EngineConfig, Engine] = {}

    def _directory(self, config: EngineConfig) -> Path:
        """A fresh directory per start, so a restarted engine keeps its earlier log."""
        return self._workdir / f"{len(self.starts):02d}-{config.label}"

    @property
    def report_path(self) -> Path:
        """Where :meth:`close` writes the session's report."""
        return self._workdir / "report.json"

    def engine(self, config: EngineConfig) -> Engine:
        """The running engine of ``config``, started (after stopping the oldest) if needed."""
        engine = self._live.get(config)
        if engine is not None and engine.running:
            self._live.move_to_end(config)
            self.last_used = engine
            return engine
        if engine is not None:
            self._live.pop(config)
            engine.close()
        while len(self._live) >= self._max_live:
            _, oldest = self._live.popitem(last=False)
            oldest.close()
        _logger.info("starting engine %s", config.label)
        # One model directory per pool: engines of one model serve one path, as replicas do.
        engine = start_engine(config, self._directory(config), models=self._workdir / "models")
        self.starts.append(EngineStart(config.label, engine.start_seconds, engine.log_path))
        self._live[config] = engine
        self._latest[config] = engine
        self.last_used = engine
        return engine

    def log_path(self, config: EngineConfig) -> Path:
        """The server log of ``config``'s latest start, running or stopped since.

        Reading what an engine logged at start-up (its pool sizing, its backends) needs no
        running engine: only a configuration never started here is started for it.
        """
        latest = self._latest.get(config)
        return latest.log_path if latest is not None else self.engine(config).log_path

    def generate(self, config: EngineConfig, request: GenerateRequest) -> Generation:
        """``request`` served by ``config``'s engine, once per session."""
        key = (config, request)
        if key not in self._results:
            self._results[key] = self.engine(config).generate(request)
        return self._results[key]

    def generate_all(
        self, config: EngineConfig, requests: Iterable[GenerateRequest]
    ) -> tuple[Generation, ...]:
        """Each of ``requests`` served by ``config``'s engine, in order, each once per session."""
        return tuple(self.generate(config, request) for request in requests)

    def generate_together(
        self, config: EngineConfig, requests: Iterable[GenerateRequest]
    ) -> tuple[Generation, ...]:
        """``requests`` sent to ``config``'s engine at once, so they decode in one batch.

        Once per session for the same requests together; each answer is also what ``generate``
        returns for that request afterwards (the first answer served stays).
        """
        batch = tuple(requests)
        key = (config, batch)
        if key not in self._together:
            engine = self.engine(config)
            with ThreadPoolExecutor(max_workers=max(len(batch), 1)) as pool:
                self._together[key] = tuple(pool.map(engine.generate, batch))
            for request, result in zip(batch, self._together[key], strict=True):
                self._results.setdefault((config, request), result)
        return self._together[key]

    def stop_running(self) -> None:
        """Stop every running engine; their answers stay remembered.

        An idle engine is not free: a CPU engine of several ranks keeps its schedulers busy
        exchanging empty batches, on the cores other tests need.
        """
        while self._live:
            _, engine = self._live.popitem(last=False)
            engine.close()

    def close(self) -> None:
        """Stop every running engine and write ``report.json`` (see :meth:`write_report`)."""
        try:
            self.stop_running()
        finally:
            self.write_report(self.report_path)

    def write_report(self, path: Path) -> None:
        """Every engine start and every generation served, as JSON, for reading after a run."""
        report = {
            "starts": [
                {"label": s.label, "seconds": round(s.seconds, 1), "log": str(s.log_path)}
                for s in self.starts
            ],
            "generations": [
                {
                    "engine": config.label,
                    "prompt_tokens": len(request.input_ids),
                    "prompt_head": list(request.input_ids[:8]),
                    "output_ids": list(result.output_ids),
                    "logprobs": list(result.logprobs),
                    "cached_tokens": result.cached_tokens,
                }
                for (config, request), result in self._results.items()
            ],
        }
        path.write_text(json.dumps(report, indent=1), encoding="utf-8")
