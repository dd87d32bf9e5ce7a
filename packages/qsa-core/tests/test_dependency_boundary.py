"""qsa-core imports with nothing but the standard library: no torch, numpy, triton or SGLang."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_FORBIDDEN = ("torch", "numpy", "triton", "sglang", "xxhash")


def test_every_module_imports_with_heavy_packages_blocked() -> None:
    """Importing qsa_core and each of its modules never reaches a forbidden package."""
    script = textwrap.dedent(
        f"""
        import importlib, importlib.abc, pkgutil, sys

        FORBIDDEN = {_FORBIDDEN!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in FORBIDDEN:
                    raise ImportError(f"qsa_core must not import {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        import qsa_core
        names = [m.name for m in pkgutil.walk_packages(qsa_core.__path__, "qsa_core.")]
        for name in names:
            importlib.import_module(name)
        print(len(names))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 10  # the private modules were really walked
