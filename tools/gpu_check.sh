#!/usr/bin/env bash
# On a machine with a CUDA device: the GPU tests and the GPU bench sections
# (gpu: registration in place; cumem: cuMem import at CUMEM_GIB sizes, default
# 1,8; 1,8,32 needs ~45 GiB of disk), logs and figures written to $OUT. Uses
# the interpreter that already has CUDA torch (PY, default python3) with the
# project from this checkout;
# wheels the machine lacks are installed from ./wheels when that folder exists
# (pip download -d wheels pytest safetensors prometheus-client
# grpcio-health-checking rich, on a machine with the registry).
set -uo pipefail
OUT=${OUT:-/tmp/engramd-gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ -d wheels ]; then
  "$PY" -m pip install --quiet --no-index --find-links wheels \
    pytest safetensors prometheus-client grpcio-health-checking rich
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
make test-gpu PY="$PY" ARGS="-rs" > "$OUT/test-gpu.log" 2>&1
echo "make test-gpu: exit $?" | tee -a "$OUT/test-gpu.log"
PYTHONPATH="$PWD/client:$PWD" "$PY" -m bench --only gpu,cumem --size-gib "${GIB:-8}" \
  --cumem-gib "${CUMEM_GIB:-1,8}" --out "$OUT/gpu.json" > "$OUT/bench-gpu.log" 2>&1
echo "bench gpu: exit $?" | tee -a "$OUT/bench-gpu.log"
