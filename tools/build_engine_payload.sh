#!/usr/bin/env bash
# Build .gpu-payload/ (ignored by git): the wheels that `nox -s gpu-engine` installs offline on the
# GPU machine to start real SGLang 0.5.23 engines there (see docs/testing.md, "On the H200").
#
#   .gpu-payload/engine/  sglang 0.5.23 (trimmed), the real sglang-kernel 0.4.5 (trimmed to what
#                         an SM90 GPU loads) and the dependencies that machine lacks, as listed in
#                         tools/engine-payload-wheels.txt
#   .gpu-payload/nox/     nox and what it needs: the list tools/gpu_wheels.sh keeps (the script
#                         runs it, which refreshes .whl/ too, and copies its wheels)
#
# Every wheel is for cp312 manylinux x86_64 and fetched with --no-deps. The device tool carries at
# most 64 MiB per call, the working tree included, so the script prints the payload's size and
# fails when payload plus travelling tree exceed PAYLOAD_LIMIT_MIB (default 62).
#
# Usage: tools/build_engine_payload.sh          (from anywhere; needs python3 with pip and PyPI)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
limit_mib=${PAYLOAD_LIMIT_MIB:-62}
out=.gpu-payload

rm -rf "$out"
mkdir -p "$out/engine" "$out/nox"

# The GPU machine's glibc takes any of these tags; pip matches each manylinux tag exactly.
platforms=()
for tag in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
    manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform any \
    -d "$out/engine" -r tools/engine-payload-wheels.txt

# Trim in place, keeping every other file byte for byte and RECORD consistent:
# - sglang: the optional Rust extensions _server, _grpc, _bench, _multimodal and the diffusion
#   package sglang/multimodal_gen (none loads on the engine or HTTP server path; 39 MB -> 16 MB);
# - sglang-kernel: flash_ops (FA3, 1.1 GB unpacked), flashmla_ops, infllm_ops and sm100/, which an
#   SM90 GPU never loads; sm90/common_ops and spatial_ops stay.
python3 - "$out/engine" <<'PY'
import pathlib
import re
import sys
import zipfile

RULES = {
    "sglang-": re.compile(
        r"^sglang/(multimodal_gen/|srt/rust_extensions/_(server|grpc|bench|multimodal)\.)"
    ),
    "sglang_kernel-": re.compile(r"^sgl_kernel/((flash_ops|flashmla_ops|infllm_ops)[^/]*\.so$|sm100/)"),
}
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    drop = next((rule for prefix, rule in RULES.items() if wheel.name.startswith(prefix)), None)
    if drop is None:
        continue
    trimmed = wheel.with_suffix(".trimmed")
    removed = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if drop.match(info.filename):
                removed += 1
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not drop.match(line)).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    if removed == 0:
        sys.exit(f"{wheel.name}: nothing matched {drop.pattern!r}; the wheel's layout changed")
    before = wheel.stat().st_size
    trimmed.replace(wheel)
    print(f"trimmed {wheel.name}: {removed} files removed, {before} -> {wheel.stat().st_size} bytes")
PY

# nox for the GPU machine: one list of its wheels, kept by tools/gpu_wheels.sh (which fills .whl/).
tools/gpu_wheels.sh >/dev/null
cp .whl/*.whl "$out/nox/"

payload=$(du -sb "$out" | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
    awk '{s += $1} END {print s + 0}')
total=$((payload + tree))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "engine wheels: $(ls "$out/engine" | wc -l), nox wheels: $(ls "$out/nox" | wc -l)"
echo "payload $(mib "$payload") + travelling tree $(mib "$tree") = $(mib "$total") (limit ${limit_mib} MiB)"
if ((total > limit_mib * 1048576)); then
    echo "error: payload plus tree exceed ${limit_mib} MiB; the device tool carries 64 MiB per call" >&2
    exit 1
fi
