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
# Every manylinux tag a glibc >= 2.28 image accepts (pip matches tags exactly): without 2_24, current
# bitsandbytes wheels (manylinux_2_24 only) are skipped and pip falls back to 0.42.0's any-platform
# wheel (105 MB, years old).
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# pydantic refuses any pydantic-core but the one it pins: fetch pydantic at this venv's version and
# the core its own metadata requires, never two independent latest releases.
core="$("$PY" -c 'import importlib.metadata as m; print(next(r.split(";")[0].replace(" ", "") for r in m.requires("pydantic") if r.startswith("pydantic-core")))')"
case "$core" in pydantic-core==*) ;; *) echo "pydantic does not pin its core exactly ($core)" >&2; exit 1 ;; esac
names=("pydantic==$(version pydantic)" "$core" annotated-types typing-inspection datasets dill multiprocess hjson
  trl liger-kernel gguf "peft==$(version peft)")
# transformers is the image's own (5.17 on the lent H200 image, within scaletune's range): its
# 13.5 MB wheel beside bitsandbytes' 43 MB and the repository would pass the device tool's 64 MiB.
# scaletune's gpu extra asks for bitsandbytes >= 0.45: an older resolution is an error, not a fallback.
[ "${1:-}" = --with-bitsandbytes ] && names+=("bitsandbytes>=0.45")
"$PY" -m pip download -q --no-deps "${platform[@]}" -d .whl "${names[@]}"
ds="$(version deepspeed)"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$ds"
du -sh .whl
