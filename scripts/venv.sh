# Sourced by quickstart.sh and test.sh: creates .venv (if missing), activates it, defines `install`
# and installs torch first (TORCH_SPEC, default torch==2.13.0) so the project's torch range installs
# nothing more.
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate

# install ARGS: `pip install ARGS`, through uv's pip interface where uv installs (it downloads,
# unpacks and compiles in parallel), else pip. uv does not read pip's configuration, so the find-links and constraint
# files pip is configured with (a machine's local CPU torch wheel, its version caps) are passed on;
# SCALETUNE_PIP=1 uses pip alone.
install() {
  if [ -z "${SCALETUNE_PIP:-}" ] && { python -m uv --version >/dev/null 2>&1 || python -m pip install -q uv >/dev/null 2>&1; }; then
    local links constraint
    links="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-$(python -m pip config get global.find-links 2>/dev/null || true)}}"
    constraint="${UV_CONSTRAINT:-${PIP_CONSTRAINT:-$(python -m pip config get global.constraint 2>/dev/null || true)}}"
    # --compile-bytecode: pip writes every module's .pyc at install; uv does not by default, and the
    # suite's processes (which do not write bytecode) then compiled torch's and transformers' sources
    # at every start: a CI run's processes took ~2.5 times their CPU.
    if UV_FIND_LINKS="$links" UV_CONSTRAINT="$constraint" python -m uv pip install -q --compile-bytecode "$@"; then
      return 0
    fi
    echo "[venv.sh] uv pip install $* failed; installing with pip" >&2
  fi
  python -m pip install -q "$@"
}

python -c "import torch" 2>/dev/null || install "${TORCH_SPEC:-torch==2.13.0}"
