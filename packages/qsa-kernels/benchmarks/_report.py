"""What the DS-Offload benchmarks of this folder share: the machine's facts and the report files."""

from __future__ import annotations

import json
import pathlib
import platform
from collections.abc import Mapping, Sequence

import torch

__all__ = ("machine", "write")


def machine(*, cpu: str = "CPU") -> dict[str, str]:
    """The device (the GPU's name, else ``cpu``), torch's version and Python's."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu
    return {"device": device, "torch": torch.__version__, "python": platform.python_version()}


def write(
    out_dir: pathlib.Path, stem: str, data: Mapping[str, object], lines: Sequence[str]
) -> None:
    """Write ``<out_dir>/<stem>.json`` (``data``) and ``<out_dir>/<stem>.md`` (``lines``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
