# The prelude scripts/gpu_check.sh and scripts/gpu_check_multi.sh share (sourced, not run): the
# carried wheels, the environment, the report's header, and `pytest_part`. The caller sets REPORT
# (the report folder) and PY (the Python that holds CUDA PyTorch) and is in the repository root.
mkdir -p "$REPORT"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/scaletune-site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/scaletune-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# The tests read Alpaca records from ../shared/data; where only the repository travelled, the 400
# bundled records stand in (the tests use at most 64 of them).
if [ ! -f ../shared/data/alpaca_5000.json ]; then
  mkdir -p ../shared/data/tokenizers
  cp examples/data/alpaca_400.json ../shared/data/alpaca_5000.json
  cp src/scaletune/assets/olmo2-dolma2.json ../shared/data/tokenizers/olmo2-dolma2.json
fi

md="$REPORT/gpu-report.md"
if [ ! -f "$md" ]; then
  {
    echo "# scaletune GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" - <<'PYEOF'
import importlib.metadata as m
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "liger-kernel", "trl", "datasets", "pydantic", "pydantic-core"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "MISSING")
PYEOF
    echo '```'
  } >"$md" 2>&1
fi

LIMIT="${PART_LIMIT:-470}"
# A run's CLI in a fresh interpreter, not a fork of the test worker's zygote: a worker that has
# initialised CUDA (the in-process sync check) must not be what the runs fork from.
export SCALETUNE_TEST_FORK=0 SCALETUNE_GPU_REPORT="$REPORT"
status=0
# pytest_part NAME TEST...: one pytest run with its log, JUnit XML and a section of the report.
pytest_part() {
  local name="$1"
  shift
  echo "[gpu_check] part $name: $* (limit ${LIMIT}s)"
  timeout -s INT -k 30 "$LIMIT" "$PY" -m pytest -v -rA -p no:cacheprovider --junitxml="$REPORT/gpu-$name.xml" "$@" \
    2>&1 | tee "$REPORT/gpu-$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "[gpu_check] part $name stopped at its ${LIMIT}s limit" | tee -a "$REPORT/gpu-$name.log"
  status=$((status | rc))
  {
    echo
    echo "## Tests: $name (exit $rc, $(date -u +%H:%MZ))"
    echo
    echo '```'
    grep -E "(PASSED|FAILED|ERROR|SKIPPED|XFAIL)|passed|failed|stopped at" "$REPORT/gpu-$name.log" | tail -60
    echo '```'
  } >>"$md"
}
