#!/usr/bin/env bash
# GPU check of issue 9: exercise overlapkit's CUDA paths on one NVIDIA GPU in a few minutes.
#
#   bash bench/gpu/check.sh                 # all items; outputs under $OUT (or runs/gpu_check)
#   bash bench/gpu/check.sh --only doctor   # some items (see bench/gpu/check.py)
#
# Prints PASS/FAIL per item (comm hooks and GradBucketer on NCCL at world size 1, CUDA-event
# timings in comm_stats, a profiled run on two NCCL ranks sharing the GPU read by `overlapkit
# report` and compared with HTA, ok.fsdp on those ranks, overlapkit-train on CUDA, topology
# detection through NVML, `overlapkit doctor --json`) and writes gpu_check.json, the
# worker results, the trace and every command's log to $OUT. Exit code 0: all passed,
# 1: a failure, 3: no CUDA device here (everything skipped).
#
# Assumptions:
# - run from a checkout where `make` has created .venv (torch with CUDA, nvidia-ml-py, the
#   package installed editable); nothing is downloaded: the GPU machine cannot reach the
#   internet, so no pip install happens here. Without .venv, python3 from PATH is used and
#   must already have the same packages.
# - one NVIDIA GPU with its driver (NVML comes with the driver); torchrun is `python -m
#   torch.distributed.run` from the same interpreter, on a free local port (--standalone).
# - about 3 minutes in all on an idle machine (each subprocess has a timeout; the script
#   stops after 10 minutes at most).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=.venv/bin/python
if [[ ! -x "$PYTHON" ]]; then
  PYTHON=$(command -v python3)
  echo "gpu_check: no .venv here (run make first); using $PYTHON" >&2
fi
OUT_DIR=${OUT:-runs/gpu_check}
mkdir -p "$OUT_DIR"
{
  echo "# $(date -u +%FT%TZ) $(hostname) $(git rev-parse --short HEAD 2>/dev/null || echo no-git)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  nvidia-smi topo -m 2>&1 || true
} > "$OUT_DIR/machine.txt"
cat "$OUT_DIR/machine.txt"
# Keep the ranks' logs quiet and the run bounded; NCCL_DEBUG=WARN shows only problems.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} PYTHONUNBUFFERED=1
# Issue 18, when asked for: GPU_CHECK_SUITE=1 runs `make test-gpu` (the whole suite with the
# CUDA-only tests, ~10 min); GPU_CHECK_BF16=1 times ok.ddp(compress="bf16") against PyTorch's
# bf16_compress_hook on two NCCL ranks of this GPU (start CUDA MPS first: docs/emulation.md).
# `-o .venv/.installed`: use the .venv as it is (this machine cannot download).
if [[ "${GPU_CHECK_SUITE:-0}" == 1 ]]; then
  timeout 1500 make -o .venv/.installed test-gpu > "$OUT_DIR/test_gpu.log" 2>&1 \
    && echo "PASS  test-gpu" || echo "FAIL  test-gpu: $(tail -n 1 "$OUT_DIR/test_gpu.log")"
fi
if [[ "${GPU_CHECK_BF16:-0}" == 1 ]]; then
  timeout 600 "$PYTHON" -m bench.compress_hooks --device cuda --json "$OUT_DIR/compress_hooks.json" \
    > "$OUT_DIR/compress_hooks.log" 2>&1 && tail -n 5 "$OUT_DIR/compress_hooks.log" \
    || echo "FAIL  compress_hooks: $(tail -n 1 "$OUT_DIR/compress_hooks.log")"
fi
# The report and fsdp_cuda items run two NCCL ranks on this one GPU; CUDA MPS lets their kernels
# run concurrently (docs/emulation.md). Started here, and stopped at exit, when the control
# binary exists and no MPS pipe directory is set already.
MPS_CONTROL=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null || true)
if [[ -n "$MPS_CONTROL" && -z "${CUDA_MPS_PIPE_DIRECTORY:-}" ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  "$MPS_CONTROL" -d && trap 'echo quit | "$MPS_CONTROL"' EXIT && echo "gpu_check: CUDA MPS started"
fi
status=0
timeout 600 "$PYTHON" -m bench.gpu.check --out "$OUT_DIR" "$@" || status=$?
exit "$status"
