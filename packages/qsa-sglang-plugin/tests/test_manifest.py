"""The hook declaration, the shipped fingerprint manifest and its tool."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from qsa_sglang_plugin import FingerprintMismatchError
from qsa_sglang_plugin._fingerprints import (
    build_manifest,
    check_manifest,
    load_manifest,
    main,
    module_source_path,
    pinned_modules,
    verify_fingerprints,
)
from qsa_sglang_plugin._hooks import HOOKS, REGISTRATIONS, HookKind


def _imported(load: Callable[[], object]) -> object:
    """``load()``, SGLang's import-time warnings silenced.

    Loading a hook or factory imports SGLang's modules, whose import warns on a machine without
    CUDA (AWQ kernels, deprecated CUTLASS names); the first test of a process to import them
    would fail on those warnings, not on the declaration.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load()


def test_shipped_manifest_matches_installed_sglang() -> None:
    """The manifest in the package equals a fresh fingerprint of the installed sglang 0.5.23."""
    assert load_manifest() == build_manifest()
    verify_fingerprints(HOOKS, registrations=REGISTRATIONS)


def test_manifest_tool_checks_clean(capsys: pytest.CaptureFixture[str]) -> None:
    """`--check` exits 0 and reports the module and hook counts."""
    assert main(["--check"]) == 0
    assert f"{len(HOOKS)} hooks" in capsys.readouterr().out


def test_manifest_tool_writes_then_detects_drift(tmp_path: Path) -> None:
    """`--write` produces the shipped manifest; a drifted digest then fails `--check`."""
    path = tmp_path / "manifest.json"
    assert main(["--write", "--manifest", str(path)]) == 0
    assert path.read_text() == load_manifest().to_json()
    drifted = path.read_text().replace(load_manifest().modules[0][1], "0" * 64)
    path.write_text(drifted)
    assert main(["--check", "--manifest", str(path)]) == 1


def test_drifted_digest_is_refused_with_module_and_digests() -> None:
    """A digest that differs names the module, its path, the expected and the found sha256."""
    shipped = load_manifest()
    index, (module, digest) = next(
        (i, entry) for i, entry in enumerate(shipped.modules) if entry[0] == HOOKS[0].module
    )
    modules = list(shipped.modules)
    modules[index] = (module, "f" * 64)
    bad = dataclasses.replace(shipped, modules=tuple(modules))
    with pytest.raises(FingerprintMismatchError) as info:
        verify_fingerprints(HOOKS, bad)
    text = str(info.value)
    assert module in text
    assert "f" * 64 in text
    assert digest in text
    assert str(module_source_path(module)) in text


def test_manifest_that_differs_from_declaration_is_refused() -> None:
    """A manifest whose hook list is not the declaration's is stale and refused."""
    shipped = load_manifest()
    stale = dataclasses.replace(shipped, hooks=shipped.hooks[:-1])
    with pytest.raises(FingerprintMismatchError, match="regenerate"):
        check_manifest(stale)


def test_manifest_for_other_sglang_version_is_refused() -> None:
    """Only a manifest taken from sglang 0.5.23 is accepted."""
    other = dataclasses.replace(load_manifest(), sglang_version="0.5.24")
    with pytest.raises(FingerprintMismatchError, match=r"'0\.5\.24'.*supported: '0\.5\.23'"):
        check_manifest(other)


def test_declaration_is_well_formed() -> None:
    """Targets are unique, hooks import, and no whole-definition REPLACE is declared yet."""
    targets = [spec.target for spec in HOOKS]
    assert len(targets) == len(set(targets))
    for spec in HOOKS:
        assert callable(_imported(spec.load_hook))
        assert spec.reason
        assert module_source_path(spec.module).is_file()
    assert [s for s in HOOKS if s.kind is HookKind.REPLACE] == []


def test_registrations_are_well_formed_and_their_modules_pinned() -> None:
    """Each registry entry's factory imports, and every module it relies on is in the manifest."""
    shipped = {module for module, _ in load_manifest().modules}
    names = [(r.registry, r.name) for r in REGISTRATIONS]
    assert len(names) == len(set(names))
    for entry in REGISTRATIONS:
        assert callable(_imported(entry.load_factory))
        assert entry.reason
        assert entry.relies_on
        for module in entry.relies_on:
            assert module_source_path(module).is_file()
            assert module in shipped
    assert pinned_modules(HOOKS, REGISTRATIONS) == shipped


def test_drift_in_a_module_a_registration_relies_on_is_refused() -> None:
    """The lifecycle's tree-cache base class is pinned as a hook target's module is."""
    shipped = load_manifest()
    relied = REGISTRATIONS[0].relies_on[1]
    bad = dataclasses.replace(
        shipped,
        modules=tuple((m, "e" * 64 if m == relied else d) for m, d in shipped.modules),
    )
    verify_fingerprints(HOOKS, bad)  # without the registration the module is not read
    with pytest.raises(FingerprintMismatchError, match=relied.replace(".", r"\.")):
        verify_fingerprints(HOOKS, bad, REGISTRATIONS)


def test_index_sharding_declares_its_six_hooks_and_no_replace() -> None:
    """D2's hooks: the index pool's shape, its whole buffer never allocated (AROUND), owned writes
    (AROUND), the fused compress off (AFTER), prefill inputs without the logical gather (AROUND),
    the two selections (AROUND)."""
    from qsa_sglang_plugin._hooks import specs_for
    from qsa_sglang_plugin._switches import Feature

    d2 = specs_for([Feature.INDEX_SHARDING])
    assert [(s.qualname, s.kind) for s in d2] == [
        ("QSATokenToKVPool.__init__", HookKind.AROUND),
        ("QSATokenToKVPool.set_qsa_compressed_k_buffer", HookKind.AROUND),
        ("QSAIndexer._use_fused_compress", HookKind.AFTER),
        ("QSAIndexerMetadata.get_prefill_mqa_inputs", HookKind.AROUND),
        ("QSAIndexer.select_prefill_tokens", HookKind.AROUND),
        ("QSAIndexer.select_decode_tokens", HookKind.AROUND),
    ]
    assert HookKind.REPLACE not in {s.kind for s in HOOKS}
