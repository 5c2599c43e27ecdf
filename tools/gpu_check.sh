#!/usr/bin/env bash
# On a machine with a CUDA device: the GPU tests and the GPU bench sections
# (gpu: registration in place; cumem: cuMem import at CUMEM_GIB sizes, default
# 1,8; 1,8,32 needs ~45 GiB of disk), logs and figures written to $OUT. Uses
# the interpreter that already has CUDA torch (PY, default python3) with the
# project from this checkout. Wheels in .whl/ (tools/gpu_wheels.sh, run where
# the registry is reachable) are installed first, apart, for this run only.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/engramd-gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ -d .whl ]; then
  site=$(mktemp -d)
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" .whl/*.whl || exit
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
{
  nvidia-smi
  "$PY" -c 'import sys, torch, grpc, google.protobuf as p; from cuda.bindings import driver
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "grpcio", grpc.__version__, "protobuf", p.__version__)'
} > "$OUT/machine.txt" 2>&1
# Each part within its own time (TEST_S, BENCH_S), so a hung CUDA call in one
# leaves the other its turn; a test past 120 s dumps every thread's stack.
timeout "${TEST_S:-300}" make test-gpu PY="$PY" ARGS="-rs -o faulthandler_timeout=120" \
  > "$OUT/test-gpu.log" 2>&1
echo "make test-gpu: exit $?" | tee -a "$OUT/test-gpu.log"
PYTHONPATH="$PWD/client:$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "${BENCH_S:-240}" \
  "$PY" -m bench --only gpu,cumem \
  --size-gib "${GIB:-8}" --cumem-gib "${CUMEM_GIB:-1,8}" --out "$OUT/gpu.json" \
  > "$OUT/bench-gpu.log" 2>&1
echo "bench gpu: exit $?" | tee -a "$OUT/bench-gpu.log"
