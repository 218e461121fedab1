# syntax=docker/dockerfile:1
# kvrouter images (docs/deploy.md). Two targets:
#   router  (default, last stage): `kvrouter serve`, no torch, with the `kubernetes` extra.
#     docker build -t kvrouter:0.1.0 .
#     docker run -p 8000:8000 -e KVROUTER_ADMIN_TOKEN=... \
#       -v $PWD/router.toml:/etc/kvrouter/router.toml:ro kvrouter:0.1.0
#   replica: the simulated vLLM replica (`kvrouter replica`, the `emitter` extra: CPU torch).
#     docker build --target replica -t kvrouter-replica:0.1.0 .
# The install step is docker/install.sh; tests/test_install.py runs it in clean virtual
# environments and tests/test_container.py lints this file with hadolint.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------- wheel
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY events/ events/
COPY router/ router/
COPY gpu_emitter/ gpu_emitter/
# gcc in this stage only: setup.py compiles events._chain (the hash chain in C, ~5x faster;
# docs/native-hashing.md) into the wheel, and the runtime stages stay without a compiler.
# Should the compile fail, the wheel is built without it and the pure chain is used.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------- base
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kvrouter/bin:$PATH
RUN groupadd --system --gid 10001 kvrouter \
    && useradd --system --uid 10001 --gid kvrouter --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin kvrouter
COPY docker/install.sh docker/healthcheck.py /opt/kvrouter-docker/
WORKDIR /tmp

# ---------------------------------------------------------------------------- replica
# A simulated vLLM replica for tests and demos, not a model server. torch==2.13.0 comes from
# the CPU wheel index (TORCH_INDEX_URL; empty: pip's configured indexes only).
FROM base AS replica
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}" sh /opt/kvrouter-docker/install.sh /opt/kvrouter /wheels emitter
USER 10001:10001
EXPOSE 8000 5557 5558
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/opt/kvrouter-docker/healthcheck.py"]
ENTRYPOINT ["kvrouter"]
CMD ["replica", "--host", "0.0.0.0", "--port", "8000", "--layout", "fa_swa", \
     "--events-endpoint", "tcp://*:5557", "--replay-endpoint", "tcp://*:5558"]

# ---------------------------------------------------------------------------- router
# The default target. Config: the TOML mounted at /etc/kvrouter/router.toml, overridden by
# KVROUTER_* variables (router/config.py). A container listens on every interface, so the
# router refuses to start without KVROUTER_ADMIN_TOKEN (or admin_enabled = false).
FROM base AS router
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    sh /opt/kvrouter-docker/install.sh /opt/kvrouter /wheels kubernetes
ENV KVROUTER_HOST=0.0.0.0 \
    KVROUTER_PORT=8000
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "/opt/kvrouter-docker/healthcheck.py"]
ENTRYPOINT ["kvrouter"]
CMD ["serve", "--config", "/etc/kvrouter/router.toml"]
