#!/usr/bin/env bash
# Wheels for a GPU machine without network whose image has CUDA PyTorch, transformers and accelerate
# but not the rest of scaletune's needs (the device image of docs/benchmarks.md: Python 3.12,
# x86-64). Run here, where pip reaches PyPI; the folder .whl/ (in .gitignore) then travels with the
# repository (device tool: carry [".whl"]) and scripts/gpu_check.sh installs from it.
#
#   bash scripts/gpu_wheels.sh [--with-bitsandbytes]
#
# bitsandbytes' CUDA wheel is large (check the folder against the tool's 64 MiB budget); without
# it the QLoRA test skips. DeepSpeed publishes only a source archive: it is built here into a pure
# Python wheel (no ops compiled ahead; DeepSpeed builds what it needs on first use there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
mkdir -p .whl
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
names=(pydantic pydantic-core annotated-types typing-inspection datasets dill multiprocess hjson
  trl liger-kernel "transformers==$("$PY" -c 'import importlib.metadata as m; print(m.version("transformers"))')")
[ "${1:-}" = --with-bitsandbytes ] && names+=(bitsandbytes)
"$PY" -m pip download -q --no-deps "${platform[@]}" -d .whl "${names[@]}"
ds="$("$PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$ds"
du -sh .whl
