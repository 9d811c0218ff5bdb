#!/usr/bin/env bash
# The GPU tier (tests/gpu, the GPU-marked unit tests) and the gpu-1b benchmark, one report.
#
#   bash scripts/gpu_check.sh [PART] [REPORT_DIR]     (default: all, $OUT or gpu-report)
#
# PART: hour | throughput | engines | qlora | smoke | bench, each one command under 8 minutes on one H100 (a
# 10-minute command limit with room for the start); `tests` (engines, qlora, smoke) and `all` (every
# part) for machines without such a limit. `hour` is the one call for a 15-minute device budget
# (issue 38): the first-hour checks (tests/gpu/test_first_hour.py: no host sync in an unpacked step,
# bf16_params vs autocast, DPO, GRPO, resume from a GPU checkpoint on the GPU and the CPU), the
# engines in bf16, QLoRA (ZeRO-3 load included), Liger, compile, the flex/autocast probe and the
# GPU-marked unit tests on 8 pytest-xdist workers sharing the GPU (tiny models: the GPU is not the
# bottleneck). On an H200 (2026-11-30) 39 of its 41 tests ended within 280 s, so give it 330 s
# (PART_LIMIT) and the call 400. `throughput` (a call of its own): alone on the GPU, packed flex vs
# sdpa and checkpointing auto vs on, tokens/s into throughput.json; its first run had not ended
# after 150 s there. The 1.24B benchmark smoke (smoke) and the benchmark (bench) are
# parts of their own. Each pytest part runs with -v (every test's name is in the log as it starts,
# so a part killed at its limit still says where) under `timeout` ($PART_LIMIT seconds, 470 by
# default: SIGINT, so pytest still writes its summary and JUnit XML).
#
# Written for a fresh GPU machine that has the repository and Python with CUDA PyTorch but no
# network: packages its Python lacks come as wheels in .whl/ (made here by scripts/gpu_wheels.sh;
# with the device tool: carry [".whl"]). Appends each part to REPORT_DIR/gpu-report.md (the
# environment once, then test results, the benchmark table) beside the raw logs, the JUnit XML and
# the benchmark JSON, so parts run as separate calls into one folder make one report.
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:-all}"
REPORT="${2:-${OUT:-gpu-report}}"
PY="${PYTHON:-python3}"
# shellcheck source=scripts/gpu_lib.sh
. scripts/gpu_lib.sh

case "$PART" in
  hour | throughput | engines | qlora | smoke | bench | tests | all) ;;
  *) echo "unknown part $PART: hour, throughput, engines, qlora, smoke, bench, tests or all" >&2; exit 2 ;;
esac
if [ "$PART" = hour ]; then
  LIMIT="${PART_LIMIT:-330}" pytest_part hour -n 8 tests/gpu/test_first_hour.py tests/gpu/test_engines_bf16.py \
    tests/gpu/test_qlora_liger_compile.py tests/unit/test_gpu_paths.py \
    tests/unit/test_loss.py::test_liger_loss_equals_chunked_loss_in_bf16 \
    tests/unit/test_attention.py::test_flex_on_cuda_equals_dense_sdpa
fi
if [ "$PART" = throughput ] || [ "$PART" = all ]; then
  pytest_part throughput -n 0 tests/gpu/test_throughput.py
  if [ -f "$REPORT/throughput.json" ]; then
    { echo; echo "## Throughput (packed rows, 0.34B Llama, bf16)"; echo; echo '```'; cat "$REPORT/throughput.json"; echo '```'; } >>"$md"
  fi
fi
if [ "$PART" = engines ] || [ "$PART" = tests ] || [ "$PART" = all ]; then
  pytest_part engines tests/gpu/test_engines_bf16.py
fi
if [ "$PART" = qlora ] || [ "$PART" = tests ] || [ "$PART" = all ]; then
  pytest_part qlora tests/gpu/test_qlora_liger_compile.py \
    tests/unit/test_loss.py::test_liger_loss_equals_chunked_loss_in_bf16 tests/unit/test_gpu_paths.py
fi
if [ "$PART" = smoke ] || [ "$PART" = tests ] || [ "$PART" = all ]; then
  pytest_part smoke tests/gpu/test_benchmark_gpu.py
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  "$PY" benchmarks/bench.py --preset gpu-1b --cache /tmp/scaletune-bench --out "$REPORT/gpu-1b.json" \
    2>"$REPORT/bench.stderr" | tee "$REPORT/bench.log"
  status=$((status | ${PIPESTATUS[0]}))
  { echo; echo "## Benchmark (gpu-1b)"; echo; echo '```'; cat "$REPORT/bench.log"; echo '```'; } >>"$md"
fi
echo "report: $md (exit $status)"
exit "$status"
