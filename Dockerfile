# scaletune serve: the job API and web page (docs/deploy.md).
#
# CPU image (the default):
#   docker build -t scaletune .
# CUDA image: a CUDA runtime base and PyTorch's wheels for that CUDA, e.g.
#   docker build -t scaletune:cu128 \
#     --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Run (the service binds 0.0.0.0 only once a token exists: SCALETUNE_ADMIN_TOKEN makes one at start).
# Published on this host's loopback only: it speaks plain HTTP, so put a TLS proxy in front of it
# (docs/deploy.md) rather than publishing it on every interface:
#   docker run -p 127.0.0.1:8000:8000 -v scaletune-data:/var/lib/scaletune --env-file scaletune.env scaletune
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# tini as PID 1: the training jobs' own children (torchrun workers) are re-parented to PID 1 when
# their parent ends, and the service does not reap processes it did not start. A CUDA base
# (Ubuntu) has no Python of its own, or none with venv: apt installs one (24.04: 3.12; scaletune
# needs 3.11 or later).
RUN set -eux; \
    pkgs="tini"; \
    python3 -c 'import venv, ensurepip' 2>/dev/null || pkgs="$pkgs python3 python3-venv"; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/venv

# PyTorch first, from the index that matches the base (CPU wheels by default: the PyPI wheel
# would pull gigabytes of CUDA libraries into a CPU image); its own layer, cached across source
# changes. scaletune's `torch>=2.6` is then already met.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# The service's user: its home holds the default job database (~/.scaletune/serve.db), the job
# folders (~/.scaletune/jobs) and the Hugging Face cache; mount a volume there to keep them.
RUN useradd --system --create-home --home-dir /var/lib/scaletune --uid 10001 --user-group scaletune

# What .dockerignore lets in: pyproject.toml, README.md (the package's readme), src/, examples/.
COPY . /opt/scaletune-src
# The serve extra: FastAPI, uvicorn, SQLAlchemy/Alembic, psycopg (postgres:// URLs), httpx, Swagger UI.
RUN pip install "/opt/scaletune-src[serve]" \
    && mkdir -p /srv/scaletune \
    && cp -r /opt/scaletune-src/examples /srv/scaletune/examples \
    && chown -R scaletune:scaletune /srv/scaletune

USER scaletune
# The service's working directory is where submitted configs' relative paths are read from and,
# by default, the one folder jobs may read data and models from (--read-root adds others).
WORKDIR /srv/scaletune
EXPOSE 8000

# /healthz needs no token: 200 once the job database answers a query, 503 otherwise.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]

ENTRYPOINT ["tini", "--"]
# The database, the admin token, the public URL and the path prefix come from the environment
# (SCALETUNE_DB or DATABASE_URL, SCALETUNE_ADMIN_TOKEN, SCALETUNE_PUBLIC_URL, SCALETUNE_ROOT_PATH).
CMD ["scaletune", "serve", "--host", "0.0.0.0", "--port", "8000"]
