#!/usr/bin/env bash
# The distributed proofs under NCCL, for a lend of several GPUs in one machine (issue 38's second
# script; scripts/gpu_check.sh is the one-GPU hour). One report, as gpu_check.sh writes it.
#
#   bash scripts/gpu_check_multi.sh [PART] [REPORT_DIR]     (default: all, $OUT or gpu-report)
#
# The CPU tier's own parity tests, unchanged: without a flag they run on the GPUs they see (one rank
# a GPU, NCCL, DeepSpeed on CUDA), against the one-GPU run of the same config, in fp32 (TF32 stays
# off), with the bounds the CPU holds them to. Each part needs the GPUs its world sizes use:
#
#   engines  (2 GPUs) tests/distributed/test_parity.py and test_resume.py: ddp, fsdp (offload too),
#            ZeRO-1/2/3 (offloads too) and LoRA with checkpointing at world size 2, the mesh layouts
#            of world size 2 (tensor, context, pipeline), device_map under two processes; every
#            engine resumed exactly, resharded 2 -> 1 and 1 -> 2, exported from its shards.
#   edges    (3 GPUs) tests/distributed/test_edge_matrix.py: every engine at world sizes 2 and 3
#            (uneven shards and eval splits, a last partial batch, a curriculum boundary), each
#            through the plain `scaletune train ... num_processes=N`, resumed 2 -> 3 and 3 -> 2.
#   mesh     (2 GPUs; its 4-rank layouts skip below 4) tests/gpu/test_mesh_nccl.py: tensor,
#            context and pipeline 2, and data 2 by each, full and LoRA, packed and not.
#   all      every part this machine has the GPUs for; a part it cannot run is named in the report
#            as not verified.
#
# test_parity's golden losses are the CPU's (tests/assets/golden_losses.json); a GPU's fp32 kernels
# sum in another order, so that one test is left out here. Each part is one pytest call under
# `timeout` (PART_LIMIT seconds, 470 by default), on 2 pytest-xdist workers that share the GPUs (the
# runs are tiny), as gpu_check.sh's parts. GPUS overrides the count nvidia-smi gives: on a machine
# without GPUs, GPUS=3 runs the same selection on the CPU under gloo (how this script was checked).
# Packages the image lacks (DeepSpeed, peft, ...) come as wheels in .whl/ (scripts/gpu_wheels.sh;
# with the device tool: carry [".whl"]).
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:-all}"
REPORT="${2:-${OUT:-gpu-report}}"
PY="${PYTHON:-python3}"
case "$PART" in
  engines | edges | mesh | all) ;;
  *) echo "unknown part $PART: engines, edges, mesh or all" >&2; exit 2 ;;
esac
GPUS="${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')}"
case "$GPUS" in '' | *[!0-9]*) GPUS=0 ;; esac
if [ "$GPUS" -lt 2 ]; then
  echo "scripts/gpu_check_multi.sh needs 2 or more GPUs; this machine has $GPUS (the one-GPU checks: scripts/gpu_check.sh)" >&2
  exit 2
fi
# shellcheck source=scripts/gpu_lib.sh
. scripts/gpu_lib.sh
echo "[gpu_check_multi] $GPUS GPUs" | tee -a "$md"

# part NAME NEEDS TEST...: the part when this machine has NEEDS GPUs, else a line in the report.
part() {
  local name="$1" needs="$2"
  shift 2
  if [ "$GPUS" -lt "$needs" ]; then
    { echo; echo "## Tests: $name: NOT VERIFIED (needs $needs GPUs, this machine has $GPUS)"; } | tee -a "$md"
    [ "$PART" = all ] || status=2
    return
  fi
  pytest_part "$name" -n 2 "$@"
}
if [ "$PART" = engines ] || [ "$PART" = all ]; then
  part engines 2 tests/distributed/test_parity.py tests/distributed/test_resume.py \
    --deselect tests/distributed/test_parity.py::test_reference_matches_golden
fi
if [ "$PART" = edges ] || [ "$PART" = all ]; then
  part edges 3 tests/distributed/test_edge_matrix.py
fi
if [ "$PART" = mesh ] || [ "$PART" = all ]; then
  part mesh 2 tests/gpu/test_mesh_nccl.py
fi
echo "report: $md (exit $status)"
exit "$status"
