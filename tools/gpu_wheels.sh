#!/usr/bin/env bash
# Fetch, into .whl/, the wheels a GPU machine without a package registry needs
# for tools/gpu_check.sh: the generated stubs want protobuf and grpcio at least
# as new as the ones they were made with, and that image has no
# grpcio-health-checking. Versions are this checkout's venv's, so both machines
# run the same; WHEEL_PYTHON is the GPU image's Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHEEL_PYTHON=${WHEEL_PYTHON:-3.12}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
specs=$("$PY" -c 'from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("grpcio", "protobuf", "grpcio-health-checking")))')
rm -rf .whl
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
# shellcheck disable=SC2086
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$WHEEL_PYTHON" \
  --implementation cp "${platforms[@]}" -d .whl $specs
ls .whl
