#!/usr/bin/env bash
# Issue 13 on a lent GPU: per-bucket optimizer updates (GradBucketer(optimizer=)) against the
# synchronous GradBucketer and torch DDP, on real NCCL kernels, with one command:
#
#   OUT=/tmp/gpu_overlap bash bench/gpu/overlap.sh          # ~5 min; JSON, traces and logs in $OUT
#   bash bench/gpu/overlap.sh --help                        # this text
#
# Two NCCL ranks share GPU 0 under CUDA MPS, each with its own NCCL_HOSTID, so NCCL joins them
# through its socket transport over loopback (docs/emulation.md, NCCL on one
# GPU). For each model it runs python -m bench.ddp_overlap --device cuda (all cases interleaved in one
# run, including ddp_opt / bucketer_opt / bucketer_overlap with AdamW and their clipped twins
# ddp_opt_clip / bucketer_opt_clip / bucketer_overlap_clip, clip_grad_norm 1.0) and profiles the
# bucketer cases with ok.profile; `overlapkit report --json` then reads the traces.
#
# Writes to $OUT (default runs/gpu_overlap): machine.txt, ddp_overlap_<model>.json (the
# benchmark JSON: cases, overlap efficiency, speed-ups, "profiled" exposed comm per step),
# fsdp_prefetch.json (python -m bench.fsdp_prefetch --device cuda, with the step_by_block cases),
# report_<model>_<case>.json (overlapkit report on the real traces), gpu_overlap.log (everything
# printed). Exit code: 0 done, 3 no CUDA device (nothing run), other: the failing step's.
#
# Assumptions: a checkout where `make` created .venv with a CUDA torch (nothing is downloaded);
# nvidia-cuda-mps-control on PATH or in /usr/local/nvidia/bin; one GPU. Sizes follow the
# issue's H200 measurement (MLP 8 x 2048, batch 8192, fp32, TF32 off).
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
cd "$(dirname "$0")/../.."
PYTHON=.venv/bin/python
[[ -x "$PYTHON" ]] || PYTHON=$(command -v python3)
OUT_DIR=${OUT:-runs/gpu_overlap}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_overlap.log"
exec > >(tee -a "$LOG") 2>&1

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'; then
  echo "gpu_overlap: no CUDA device here; nothing run"
  exit 3
fi
{
  echo "# $(date -u +%FT%TZ) $(hostname) $(git rev-parse --short HEAD 2>/dev/null || echo no-git)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  "$PYTHON" -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
} | tee "$OUT_DIR/machine.txt"

MPS_CONTROL=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
export CUDA_MPS_PIPE_DIRECTORY="$OUT_DIR/mps" CUDA_MPS_LOG_DIRECTORY="$OUT_DIR/mpslog"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
"$MPS_CONTROL" -d
stop_mps() { echo quit | "$MPS_CONTROL" || true; }
trap stop_mps EXIT

# Per rank the benchmark sets NCCL_HOSTID=host<rank> before its first collective.
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NVIDIA_TF32_OVERRIDE=0 PYTHONUNBUFFERED=1

run_model() {  # model, extra args...
  local model=$1
  shift
  timeout 900 "$PYTHON" -m bench.ddp_overlap --device cuda --rate none --model "$model" \
    --only optimizer --optimizer adamw --tails 0,4 --profile-dir "$OUT_DIR/profile_$model" \
    --json "$OUT_DIR/ddp_overlap_$model.json" "$@"
  for case in bucketer_opt bucketer_overlap bucketer_opt_clip bucketer_overlap_clip; do
    "$PYTHON" -m overlapkit.cli report "$OUT_DIR/profile_$model/$case" --json \
      > "$OUT_DIR/report_${model}_$case.json"
  done
}

run_model mlp --layers 8 --width 2048 --batch 8192
run_model gpt_tiny --layers 8 --width 1024 --batch 16 --seq-len 256
# ok.fsdp: FSDP2 default vs ok.fsdp(prefetch=1), and the AdamW step plain / overlap_optimizer_step /
# step_by_block, on the same two ranks.
timeout 900 "$PYTHON" -m bench.fsdp_prefetch --device cuda --rate none --blocks 8 --width 2048 \
  --batch 8192 --json "$OUT_DIR/fsdp_prefetch.json" \
  --cases compute_only,fsdp2_default,fsdp2_prefetch1,ok_prefetch1,adamw,adamw_overlap_step,adamw_by_block
echo "gpu_overlap: done; results in $OUT_DIR"
