#!/usr/bin/env bash
# Download the wheels that the GPU machine lacks into .whl/ (ignored by git), so that a device run can
# install them offline:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# That machine already has torch, triton, pytest, hypothesis, numpy, xxhash and attrs.
# We bring nox (to run `nox -s gpu-tests` / `nox -s bench`) and what nox needs beyond that.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d .whl \
    nox argcomplete colorlog dependency-groups virtualenv distlib platformdirs humanize \
    python-discovery packaging filelock
ls -1 .whl
