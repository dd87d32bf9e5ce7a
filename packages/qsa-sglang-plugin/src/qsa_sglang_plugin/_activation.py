"""Activation: register and apply the declared hooks, verify them, write activation records.

:func:`activate` is the ``sglang.srt.plugins`` entry point. SGLang calls it with no arguments in
every process that runs ``load_plugins()``. With every switch off it returns at once, imports no
SGLang module and registers nothing. Otherwise, before registering anything, it checks the SGLang
version, the fingerprints of every target module and that no other plugin has hooks on or around
a target; then it applies its own targets itself (SGLang's ``apply_hooks`` would log and swallow a
failure) and checks that each one changed. Every failure raises an :class:`ActivationError`.

:func:`verify_final` runs again in each scheduler process once every plugin has loaded and
writes that process's :class:`ActivationRecord` to ``$SGLANG_QSA_HISPARSE_ACTIVATION_DIR``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qsa_sglang_plugin._errors import ActivationError, ForeignHookError, HookNotAppliedError
from qsa_sglang_plugin._fingerprints import verify_fingerprints
from qsa_sglang_plugin._hooks import (
    HookSpec,
    Registry,
    RegistrySpec,
    registrations_for,
    specs_for,
)
from qsa_sglang_plugin._switches import (
    ENV_ACTIVATION_DIR,
    PLUGIN_NAME,
    Switches,
    current_switches,
)
from qsa_sglang_plugin._versions import installed_versions

__all__ = (
    "DIST_NAME",
    "ActivationRecord",
    "activate",
    "activation_state",
    "after_configure_scheduler_process",
    "read_records",
    "verify_active",
    "verify_final",
    "write_atomic",
    "write_record",
)

logger = logging.getLogger(__name__)

DIST_NAME = "qsa-sglang-plugin"


@dataclass(slots=True)
class _State:
    switches: Switches
    specs: tuple[HookSpec, ...]
    hooks: dict[str, Callable[..., Any]] = field(default_factory=dict)
    installed: dict[str, object] = field(default_factory=dict)


_STATE: _State | None = None


def activation_state() -> tuple[Switches, tuple[HookSpec, ...]] | None:
    """The switches and installed hooks of this process, or None when the plugin is inactive."""
    if _STATE is None:
        return None
    return _STATE.switches, _STATE.specs


def _overlaps(a: str, b: str) -> bool:
    """True when one dotted path equals, contains or is contained in the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _is_ours(source: object) -> bool:
    return getattr(source, "plugin_name", None) == PLUGIN_NAME


def _raw_attribute(target: str) -> object:
    """The object stored at ``target`` (a class's ``__dict__`` entry, so descriptors stay raw)."""
    import pkgutil

    owner_path, _, attr = target.rpartition(".")
    owner = pkgutil.resolve_name(owner_path)
    if isinstance(owner, type) and attr in owner.__dict__:
        return owner.__dict__[attr]
    return getattr(owner, attr)


def _refuse_foreign(
    registry_hooks: Mapping[str, Sequence[tuple[Any, Any, Any]]],
    targets: Sequence[str],
    own: Mapping[str, Callable[..., Any]],
) -> None:
    """Raise :class:`ForeignHookError` listing :func:`_foreign_entries`, if there are any."""
    foreign = _foreign_entries(registry_hooks, targets, own)
    if foreign:
        msg = f"other hooks are registered on or around {PLUGIN_NAME} targets: {foreign!r}"
        raise ForeignHookError(msg)


def _foreign_entries(
    registry_hooks: Mapping[str, Sequence[tuple[Any, Any, Any]]],
    targets: Sequence[str],
    own: Mapping[str, Callable[..., Any]],
) -> list[str]:
    """Registry entries that overlap ``targets`` and are not this plugin's own registrations."""
    found = []
    for reg_target, entries in registry_hooks.items():
        for hook_type, hook, source in entries:
            if _is_ours(source):
                if own.get(reg_target) is not hook:
                    found.append(f"{reg_target} (an entry claiming plugin {PLUGIN_NAME!r})")
                continue
            if any(_overlaps(reg_target, t) for t in targets):
                who = getattr(source, "plugin_name", None) or "unknown source"
                dist = getattr(source, "dist_name", None)
                label = f"{who}, dist {dist}" if dist else who
                found.append(f"{reg_target} ({getattr(hook_type, 'value', hook_type)} by {label})")
    return found


def activate() -> None:
    """Entry point of group ``sglang.srt.plugins``, name ``qsa_hisparse``.

    Idempotent per process. With every switch off it does nothing. It fails closed: SGLang's
    ``load_plugins()`` logs an ``Exception`` and serves on without the plugin, so any error
    while activating, expected or not, leaves as an :class:`ActivationError` (a
    ``BaseException``) that stops the process.

    Raises:
        ActivationError: a malformed switch, SGLang version or fingerprint drift, a foreign
            hook on a target, a hook that did not apply, or any other error on the way (its
            type and message kept).
    """
    try:
        _activate()
    except Exception as exc:
        msg = f"{PLUGIN_NAME} could not activate: {type(exc).__name__}: {exc}"
        raise ActivationError(msg) from exc


def _activate() -> None:
    global _STATE  # noqa: PLW0603 (one activation per process, by design)
    switches = current_switches()
    if not switches.any_on:
        return
    if _STATE is not None:
        return
    specs = specs_for(switches.features)
    verify_fingerprints(specs, registrations=registrations_for(switches.features))

    from sglang.srt.plugins.hook_registry import (
        HookRegistry,
        HookSource,
        HookType,
    )

    targets = [s.target for s in specs]
    _refuse_foreign(HookRegistry._hooks, targets, {})
    already = sorted(t for t in HookRegistry._patched if any(_overlaps(t, x) for x in targets))
    if already:
        msg = f"targets already patched before {PLUGIN_NAME} activated: {already!r}"
        raise ForeignHookError(msg)

    state = _State(switches=switches, specs=specs)
    source = HookSource(plugin_name=PLUGIN_NAME, dist_name=DIST_NAME)
    for spec in specs:
        hook = spec.load_hook()
        state.hooks[spec.target] = hook
        HookRegistry.register(spec.target, hook, HookType(spec.kind.value), source=source)
    for spec in specs:
        before = _raw_attribute(spec.target)
        try:
            HookRegistry._apply_target(spec.target, HookRegistry._hooks[spec.target])
        except Exception as exc:
            msg = f"hook {spec.kind.value} on {spec.target} did not apply: {exc!r}"
            raise HookNotAppliedError(msg) from exc
        HookRegistry._patched.add(spec.target)
        after = _raw_attribute(spec.target)
        if after is before:
            msg = f"hook {spec.kind.value} on {spec.target} did not apply: the target is unchanged"
            raise HookNotAppliedError(msg)
        state.installed[spec.target] = after
    for entry in registrations_for(switches.features):
        _register(entry)
    _STATE = state
    logger.info(
        "%s active: features=%s hooks=%d registrations=%s",
        PLUGIN_NAME,
        [f.value for f in switches.features],
        len(specs),
        [f"{r.registry.name.lower()}:{r.name}" for r in registrations_for(switches.features)],
    )


def _register(entry: RegistrySpec) -> None:
    """Add ``entry`` to its SGLang registry; refuse a name another plugin took first."""
    module_name, _, function = entry.registry.value.partition(":")
    module = importlib.import_module(module_name)
    if entry.registry is Registry.RADIX_CACHE_BACKEND:
        if entry.name in module.registered_radix_cache_backends():
            msg = (
                f"radix-cache backend {entry.name!r} is already registered by another plugin; "
                f"{PLUGIN_NAME} needs that name"
            )
            raise ForeignHookError(msg)
        getattr(module, function)(entry.name, entry.load_factory())
    elif entry.registry is Registry.ATTENTION_BACKEND:
        if entry.name in module.ATTENTION_BACKENDS:
            msg = (
                f"attention backend {entry.name!r} is already registered by another plugin; "
                f"{PLUGIN_NAME} needs that name"
            )
            raise ForeignHookError(msg)
        getattr(module, function)(entry.name)(entry.load_factory())
        from sglang.srt.arg_groups.choices import (
            ATTENTION_BACKEND_CHOICES,
            add_attention_backend_choices,
        )

        if entry.name not in ATTENTION_BACKEND_CHOICES:  # the CLI's and ServerArgs' choices
            add_attention_backend_choices([entry.name])


def verify_active() -> None:
    """Re-check in this process that every installed hook is still in place and unshared.

    Raises:
        ActivationError: the plugin is inactive although a switch is on.
        HookNotAppliedError: a target no longer holds the installed wrapper.
        ForeignHookError: another plugin registered hooks on or around a target.
    """
    if _STATE is None:
        if current_switches().any_on:
            msg = (
                f"{PLUGIN_NAME} switches are on but the plugin did not activate in pid "
                f"{os.getpid()}"
            )
            raise ActivationError(msg)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    changed = [t for t, obj in _STATE.installed.items() if _raw_attribute(t) is not obj]
    if changed:
        msg = f"targets were re-patched after {PLUGIN_NAME} activated: {changed!r}"
        raise HookNotAppliedError(msg)
    _refuse_foreign(HookRegistry._hooks, list(_STATE.installed), _STATE.hooks)


@dataclass(frozen=True, slots=True)
class ActivationRecord:
    """What one verified process reports to the launcher (one JSON file per process).

    Attributes:
        pid: process id.
        role: ``"scheduler"`` for scheduler processes.
        tp_rank: tensor-parallel rank.
        pp_rank: pipeline-parallel rank.
        features: requested features, in declaration order.
        hisparse_mode: the ``SGLANG_QSA_HISPARSE_V3`` value, or None.
        prefix_cache_mb: prefix-cache budget per TP rank in MiB (0 = off).
        hooks: installed hooks as ``(target, kind, feature)``.
        versions: installed distribution versions (None = absent), and ``python``.
        verified: True; a record is only written after verification passed.
        created_unix: wall-clock seconds when the record was written.
        registrations: SGLang registry entries added, as ``(registry, name, feature)``: what
            of the requested features is wired in, beyond hooks.
    """

    pid: int
    role: str
    tp_rank: int
    pp_rank: int
    features: tuple[str, ...]
    hisparse_mode: str | None
    prefix_cache_mb: int
    hooks: tuple[tuple[str, str, str], ...]
    versions: Mapping[str, str | None]
    verified: bool = True
    created_unix: float = 0.0
    registrations: tuple[tuple[str, str, str], ...] = ()

    def to_json(self) -> str:
        payload = {
            "pid": self.pid,
            "role": self.role,
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "features": list(self.features),
            "hisparse_mode": self.hisparse_mode,
            "prefix_cache_mb": self.prefix_cache_mb,
            "hooks": [{"target": t, "kind": k, "feature": f} for t, k, f in self.hooks],
            "versions": dict(self.versions),
            "verified": self.verified,
            "created_unix": self.created_unix,
            "registrations": [
                {"registry": r, "name": n, "feature": f} for r, n, f in self.registrations
            ],
        }
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ActivationRecord:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: the text is not a well-formed record.
        """
        try:
            p = json.loads(text)
            return cls(
                pid=int(p["pid"]),
                role=str(p["role"]),
                tp_rank=int(p["tp_rank"]),
                pp_rank=int(p["pp_rank"]),
                features=tuple(str(f) for f in p["features"]),
                hisparse_mode=None if p["hisparse_mode"] is None else str(p["hisparse_mode"]),
                prefix_cache_mb=int(p["prefix_cache_mb"]),
                hooks=tuple(
                    (str(h["target"]), str(h["kind"]), str(h["feature"])) for h in p["hooks"]
                ),
                versions={str(k): None if v is None else str(v) for k, v in p["versions"].items()},
                registrations=tuple(
                    (str(r["registry"]), str(r["name"]), str(r["feature"]))
                    for r in p["registrations"]
                ),
                verified=p["verified"] is True,
                created_unix=float(p["created_unix"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            msg = f"malformed activation record: {exc!r}"
            raise ValueError(msg) from exc

    @property
    def filename(self) -> str:
        return f"{self.role}-tp{self.tp_rank}-pp{self.pp_rank}-pid{self.pid}.json"


def write_record(record: ActivationRecord, directory: Path) -> Path:
    """Write ``record`` into ``directory`` atomically (temporary file, then rename).

    Returns:
        The record's final path.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / record.filename
    write_atomic(final, record.to_json())
    return final


def write_atomic(final: Path, text: str) -> None:
    """Write ``text`` to ``final`` through a synced ``.tmp-*.json`` file in the same directory.

    Readers see the old file or the whole new one, never a partial write; :func:`read_records`
    skips the temporary files.
    """
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=final.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_records(directory: Path) -> tuple[list[ActivationRecord], list[str]]:
    """All records in ``directory`` and the problems found (unreadable or malformed files)."""
    records: list[ActivationRecord] = []
    problems: list[str] = []
    if not directory.is_dir():
        return records, problems
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith(".tmp-"):
            continue
        try:
            records.append(ActivationRecord.from_json(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            problems.append(f"{path.name}: {exc}")
    return records, problems


def verify_final(role: str, *, tp_rank: int, pp_rank: int) -> ActivationRecord | None:
    """Re-verify this process and write its activation record.

    Called in every scheduler process after ``load_plugins()`` returned, so hooks registered by
    plugins loaded after this one are visible.

    Returns:
        The record written (also when no activation directory is set), or None when every switch
        is off.

    Raises:
        ActivationError: any verification failed; no record is written.
    """
    verify_active()
    if _STATE is None:
        return None
    verify_fingerprints(_STATE.specs, registrations=registrations_for(_STATE.switches.features))
    record = ActivationRecord(
        pid=os.getpid(),
        role=role,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        features=tuple(f.value for f in _STATE.switches.features),
        hisparse_mode=None if _STATE.switches.hisparse is None else _STATE.switches.hisparse.value,
        prefix_cache_mb=_STATE.switches.prefix_cache_mb,
        hooks=tuple((s.target, s.kind.value, s.feature.value) for s in _STATE.specs),
        versions=installed_versions(),
        created_unix=time.time(),
        registrations=tuple(
            (r.registry.name.lower(), r.name, r.feature.value)
            for r in registrations_for(_STATE.switches.features)
        ),
    )
    directory = os.environ.get(ENV_ACTIVATION_DIR, "")
    if directory:
        path = write_record(record, Path(directory))
        logger.info("%s activation record written: %s", PLUGIN_NAME, path)
    return record


def after_configure_scheduler_process(result: object, *args: object, **kwargs: object) -> None:
    """AFTER hook on ``sglang.srt.managers.scheduler.configure_scheduler_process``.

    By then ``run_scheduler_process`` has loaded every plugin and published this rank's parallel
    context, so the ranks come from SGLang's ``get_parallel()``.
    """
    del result, args, kwargs
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    verify_final("scheduler", tp_rank=int(parallel.tp_rank), pp_rank=int(parallel.pp_rank))
