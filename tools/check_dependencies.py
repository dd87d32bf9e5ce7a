"""Check that each workspace package declares exactly what its source imports.

For every ``packages/*/pyproject.toml``, the modules that ``src/`` imports (anywhere in a file,
lazy imports and ``pytest_plugins`` included) are mapped to distributions and compared with
``[project] dependencies`` and its optional extras:

- a distribution imported but not declared fails (it would be missing where only the declared
  dependencies are installed);
- a workspace package declared but never imported fails (the edge is not real);
- an import of another workspace package's private module (a name starting with ``_``) fails: the
  packages meet at their public names only.

Third-party distributions that are declared but not imported are allowed (runtime plugins such as
``triton`` for ``torch``). Standard-library modules are ignored. Run by ``nox -s lint``; exits 1
with one line per problem.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Import names whose distribution is spelled otherwise.
DISTRIBUTION_OF = {
    "PIL": "pillow",
    "mooncake": "mooncake-transfer-engine-non-cuda",
    "prometheus_client": "prometheus-client",
    "yaml": "pyyaml",
}


@dataclass(frozen=True)
class Package:
    """One workspace package: its distribution name, import name, directory and dependencies."""

    name: str
    module: str
    path: pathlib.Path
    dependencies: frozenset[str]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _packages() -> dict[str, Package]:
    """Import name -> package, for every workspace package."""
    found = {}
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        src = pyproject.parent / "src"
        (module,) = [p.name for p in src.iterdir() if (p / "__init__.py").is_file()]
        specs = [*project.get("dependencies", [])]
        for extra in project.get("optional-dependencies", {}).values():
            specs += extra  # an extra's imports are declared by it
        declared = frozenset(
            _normalise(re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0]) for spec in specs
        )
        found[module] = Package(_normalise(project["name"]), module, pyproject.parent, declared)
    return found


def _imports(path: pathlib.Path) -> Iterator[tuple[int, str]]:
    """``(line, dotted module)`` of every absolute import in one file.

    A ``pytest_plugins`` list of module names counts: pytest imports them.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets)
            and isinstance(node.value, (ast.Tuple, ast.List))
        ):
            for element in node.value.elts:
                if isinstance(element, ast.Constant) and isinstance(element.value, str):
                    yield node.lineno, element.value
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def problems() -> list[str]:
    """Every mismatch between declarations and imports, one line each."""
    packages = _packages()
    by_name = {p.name: p for p in packages.values()}
    out = []
    for package in packages.values():
        used: set[str] = set()
        for path in sorted((package.path / "src").rglob("*.py")):
            where = path.relative_to(ROOT)
            for line, module in _imports(path):
                top, *rest = module.split(".")
                if top == package.module or top in sys.stdlib_module_names or top == "__future__":
                    continue
                other = packages.get(top)
                dist = other.name if other else _normalise(DISTRIBUTION_OF.get(top, top))
                used.add(dist)
                if dist not in package.dependencies:
                    out.append(
                        f"{where}:{line}: imports {module} but {package.name} does not "
                        f"declare {dist}"
                    )
                if other and any(part.startswith("_") for part in rest):
                    out.append(f"{where}:{line}: imports {module}, a private module of {dist}")
        for dist in sorted(package.dependencies & set(by_name) - used):
            out.append(
                f"packages/{package.path.name}/pyproject.toml: {package.name} declares "
                f"{dist} but its source never imports it"
            )
    return out


def main() -> int:
    """Print every problem; 0 when there is none."""
    found = problems()
    summary = f"check_dependencies: {len(found)} problem(s) in {len(_packages())} packages"
    sys.stdout.write("".join(f"{line}\n" for line in [*found, summary]))
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
