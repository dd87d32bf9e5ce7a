"""Source fingerprints of the SGLang modules that hold hook targets, and the manifest tool.

The manifest (``manifest.json``, package data) records, for the supported SGLang version, the
sha256 of the source file of every module named by :data:`qsa_sglang_plugin._hooks.HOOKS` and of
every module a :data:`~qsa_sglang_plugin._hooks.REGISTRATIONS` entry relies on, and the hook list
itself. Activation refuses to hook a module whose bytes differ, and refuses a
manifest whose hook list no longer equals the declaration.

Regenerate and check (against an installed sglang 0.5.23)::

    python -m qsa_sglang_plugin._fingerprints --write
    python -m qsa_sglang_plugin._fingerprints --check

Files are located without importing SGLang, so checking costs only the reads.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from qsa_sglang_plugin._errors import FingerprintMismatchError
from qsa_sglang_plugin._hooks import HOOKS, REGISTRATIONS, HookSpec, RegistrySpec

__all__ = (
    "MANIFEST_PATH",
    "SUPPORTED_SGLANG_VERSION",
    "Manifest",
    "build_manifest",
    "check_manifest",
    "load_manifest",
    "main",
    "module_source_path",
    "pinned_modules",
    "verify_fingerprints",
)

SUPPORTED_SGLANG_VERSION: Final = "0.5.23"
MANIFEST_PATH: Final = Path(__file__).with_name("manifest.json")


@dataclass(frozen=True, slots=True)
class Manifest:
    """The shipped fingerprints.

    Attributes:
        sglang_version: the SGLang version the digests were taken from.
        modules: ``(module name, sha256 hex of its source file)`` pairs, sorted by name.
        hooks: ``(target, kind, feature)`` triples in declaration order.
    """

    sglang_version: str
    modules: tuple[tuple[str, str], ...]
    hooks: tuple[tuple[str, str, str], ...]

    def digest_of(self, module: str) -> str | None:
        """The recorded sha256 of ``module``, or None when the manifest does not list it."""
        return dict(self.modules).get(module)

    def to_json(self) -> str:
        """Stable JSON text (sorted keys, trailing newline)."""
        payload = {
            "sglang_version": self.sglang_version,
            "modules": dict(self.modules),
            "hooks": [{"target": t, "kind": k, "feature": f} for t, k, f in self.hooks],
        }
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse :meth:`to_json` output."""
        payload = json.loads(text)
        return cls(
            sglang_version=str(payload["sglang_version"]),
            modules=tuple(sorted((str(k), str(v)) for k, v in payload["modules"].items())),
            hooks=tuple(
                (str(h["target"]), str(h["kind"]), str(h["feature"])) for h in payload["hooks"]
            ),
        )


def pinned_modules(
    specs: Iterable[HookSpec], registrations: Iterable[RegistrySpec] = ()
) -> frozenset[str]:
    """The SGLang modules whose bytes the plugin depends on: hook targets' and registrations'."""
    return frozenset(m for s in specs for m in (s.module, *s.relies_on)) | frozenset(
        m for r in registrations for m in r.relies_on
    )


def _hook_rows(specs: Iterable[HookSpec]) -> tuple[tuple[str, str, str], ...]:
    return tuple((s.target, s.kind.value, s.feature.value) for s in specs)


def module_source_path(module: str) -> Path:
    """The source file of an SGLang module, without importing it.

    An already imported module answers with its own ``__file__``; otherwise the file is found
    under the ``sglang`` package directory that ``import sglang`` would use.

    Raises:
        FingerprintMismatchError: the module's source file does not exist.
    """
    loaded = sys.modules.get(module)
    loaded_file = getattr(loaded, "__file__", None)
    if isinstance(loaded_file, str):
        return Path(loaded_file)
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        msg = f"package {top!r} is not installed; cannot fingerprint {module!r}"
        raise FingerprintMismatchError(msg)
    base = Path(next(iter(spec.submodule_search_locations)))
    rel = Path(*rest.split(".")) if rest else Path()
    for candidate in (base / rel.with_suffix(".py"), base / rel / "__init__.py"):
        if rest and candidate.is_file():
            return candidate
    msg = f"source of module {module!r} not found under {str(base)!r}"
    raise FingerprintMismatchError(msg)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_manifest(
    specs: Sequence[HookSpec] = HOOKS, registrations: Sequence[RegistrySpec] = REGISTRATIONS
) -> Manifest:
    """Fingerprint the installed SGLang for ``specs`` and ``registrations``."""
    version = importlib.metadata.version("sglang")
    modules = sorted(pinned_modules(specs, registrations))
    return Manifest(
        sglang_version=version,
        modules=tuple((m, _sha256(module_source_path(m))) for m in modules),
        hooks=_hook_rows(specs),
    )


def load_manifest(path: Path = MANIFEST_PATH) -> Manifest:
    """Read the shipped manifest."""
    return Manifest.from_json(path.read_text(encoding="utf-8"))


def check_manifest(manifest: Manifest, specs: Sequence[HookSpec] = HOOKS) -> None:
    """Require the manifest to describe exactly the declared hooks and the supported version.

    Raises:
        FingerprintMismatchError: the manifest is stale or for another SGLang version.
    """
    if manifest.sglang_version != SUPPORTED_SGLANG_VERSION:
        msg = (
            f"fingerprint manifest is for sglang {manifest.sglang_version!r}; "
            f"supported: {SUPPORTED_SGLANG_VERSION!r}"
        )
        raise FingerprintMismatchError(msg)
    declared = _hook_rows(specs)
    if manifest.hooks != declared:
        msg = (
            f"fingerprint manifest lists hooks {list(manifest.hooks)!r} but the declaration has "
            f"{list(declared)!r}; regenerate it with "
            "'python -m qsa_sglang_plugin._fingerprints --write'"
        )
        raise FingerprintMismatchError(msg)
    missing = sorted(pinned_modules(specs, REGISTRATIONS) - {m for m, _ in manifest.modules})
    if missing:
        msg = f"fingerprint manifest has no digest for modules {missing!r}"
        raise FingerprintMismatchError(msg)


def verify_fingerprints(
    specs: Sequence[HookSpec],
    manifest: Manifest | None = None,
    registrations: Sequence[RegistrySpec] = (),
) -> None:
    """Require the installed SGLang version and every pinned module's bytes to match.

    Args:
        specs: the hooks about to be (or already) installed.
        manifest: the manifest to check against; the shipped one when None.
        registrations: the registry entries about to be (or already) added.

    Raises:
        FingerprintMismatchError: naming the version, or each module with its path, the
            expected and the actual sha256.
    """
    installed = importlib.metadata.version("sglang")
    if installed != SUPPORTED_SGLANG_VERSION:
        msg = f"sglang {installed!r} is installed; supported: {SUPPORTED_SGLANG_VERSION!r}"
        raise FingerprintMismatchError(msg)
    shipped = manifest if manifest is not None else load_manifest()
    check_manifest(shipped, HOOKS)
    problems = []
    for module in sorted(pinned_modules(specs, registrations)):
        path = module_source_path(module)
        actual = _sha256(path)
        expected = shipped.digest_of(module)
        if actual != expected:
            problems.append(
                f"{module} ({str(path)!r}): expected sha256 {expected!r}, found {actual!r}"
            )
    if problems:
        msg = "SGLang source differs from the fingerprint manifest: " + "; ".join(problems)
        raise FingerprintMismatchError(msg)


def main(argv: Sequence[str] | None = None) -> int:
    """Write or check ``manifest.json`` against the installed SGLang; 0 when it matches."""
    parser = argparse.ArgumentParser(
        prog="python -m qsa_sglang_plugin._fingerprints",
        description="Regenerate or check the SGLang fingerprint manifest.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the manifest")
    mode.add_argument("--check", action="store_true", help="check the manifest")
    parser.add_argument("--manifest", type=Path, default=MANIFEST_PATH, help="manifest path")
    args = parser.parse_args(argv)
    fresh = build_manifest()
    if args.write:
        if fresh.sglang_version != SUPPORTED_SGLANG_VERSION:
            sys.stderr.write(
                f"refusing to write: sglang {fresh.sglang_version!r} is installed, "
                f"supported: {SUPPORTED_SGLANG_VERSION!r}\n"
            )
            return 1
        args.manifest.write_text(fresh.to_json(), encoding="utf-8")
        sys.stdout.write(
            f"wrote {args.manifest} ({len(fresh.modules)} modules, {len(fresh.hooks)} hooks)\n"
        )
        return 0
    try:
        shipped = load_manifest(args.manifest)
        check_manifest(shipped)
        verify_fingerprints(HOOKS, shipped, REGISTRATIONS)
    except FingerprintMismatchError as exc:
        sys.stderr.write(f"manifest check failed: {exc}\n")
        return 1
    sys.stdout.write(
        f"manifest matches ({len(shipped.modules)} modules, {len(shipped.hooks)} hooks)\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
