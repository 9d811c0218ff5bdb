# Sourced by quickstart.sh and test.sh: creates .venv if missing, activates it, and installs
# torch first (TORCH_SPEC, default torch==2.13.0) so the project's torch range installs nothing more.
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
