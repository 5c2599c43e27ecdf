#!/usr/bin/env bash
# On a machine with a CUDA device: what the device says, the GPU tests and the
# GPU bench sections (gpu: registration in place; cumem: cuMem import), logs
# and figures written to $OUT, in at most 5 minutes in all (TEST_S + BENCH_S +
# the machine's description: 10 + 20 + 30 + 160 + 80 s at most), so a rerun fits a 15-minute device budget.
# Sizes start at 1 GiB (GIB, CUMEM_GIB): a VM's memory may start small and grow.
# Uses the interpreter that already has CUDA torch (PY, default python3) with
# the project from this checkout; no make. Wheels in .whl/ (tools/gpu_wheels.sh,
# run where the registry is reachable) are installed first, apart, for this run.
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
export PYTHONPATH="$PWD/client:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  timeout 10 nvidia-smi
  timeout 20 "$PY" - <<'PY'
import sys
import torch, grpc, google.protobuf as p
from cuda.bindings import driver as cu, runtime as rt
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "grpcio", grpc.__version__, "protobuf", p.__version__)
print("cuInit", cu.cuInit(0)[0])
print("cuDriverGetVersion", cu.cuDriverGetVersion()[1])
print("cudaRuntimeGetVersion", rt.cudaRuntimeGetVersion()[1])
for name in ("HostRegisterReadOnlySupported", "PageableMemoryAccessUsesHostPageTables",
             "PageableMemoryAccess", "CanUseHostPointerForRegisteredMem"):
    attr = getattr(rt.cudaDeviceAttr, "cudaDevAttr" + name, None)
    print("cudaDevAttr" + name, "absent" if attr is None else rt.cudaDeviceGetAttribute(attr, 0))
for name in ("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
             "HANDLE_TYPE_FABRIC_SUPPORTED", "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
             "HOST_NUMA_ID", "READ_ONLY_HOST_REGISTER_SUPPORTED",
             "PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES"):
    attr = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name, None)
    print("CU_DEVICE_ATTRIBUTE_" + name,
          "absent" if attr is None else cu.cuDeviceGetAttribute(attr, cu.cuDeviceGet(0)[1]))
PY
  echo "--- cuda-host trial (engramd.backings.cudaprobe, one granule, in a child)"
  timeout 30 "$PY" -m engramd.backings.cudaprobe 0 0 0; echo "exit $?"
  echo "--- /proc/meminfo"
  cat /proc/meminfo
} > "$OUT/machine.txt" 2>&1
# Each part within its own time, so a hung CUDA call in one leaves the other its
# turn; a test past 90 s dumps every thread's stack. GPU tests skip with the
# device's reason where a route is unsupported (-rs lists the reasons). Among them,
# tests/gpu/test_live_views.py: a live table's move re-registered at the same address,
# a CUDA graph captured before it replayed after.
timeout "${TEST_S:-160}" "$PY" -m pytest -m gpu tests/gpu -rs -o faulthandler_timeout=90 \
  > "$OUT/test-gpu.log" 2>&1
echo "pytest tests/gpu: exit $?" | tee -a "$OUT/test-gpu.log"
timeout "${BENCH_S:-80}" "$PY" -m bench --only gpu,cumem \
  --size-gib "${GIB:-1}" --cumem-gib "${CUMEM_GIB:-1}" --out "$OUT/gpu.json" \
  > "$OUT/bench-gpu.log" 2>&1
echo "bench gpu: exit $?" | tee -a "$OUT/bench-gpu.log"
