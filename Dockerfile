# gpuobj container images, one Dockerfile, two targets:
#
#   docker build --target operator -t ghcr.io/gpuobj/gpuobj-operator:0.1.0 .   # ENTRYPOINT gpuobj operator
#   docker build --target agent    -t ghcr.io/gpuobj/gpuobj-agent:0.1.0 .      # ENTRYPOINT gpuobj agent
#
# Stages: `builder` builds the gpuobj wheel (pyproject.toml; packages gpuobj, gpuobj_contract from
# contract/, gpuobj_kube from kube/, gpuobj_agent from agent/, gpuobj_operator from operator/; never the
# dev tooling in dev/) and the operator's virtualenv (the wheel's `operator` extra); `agent-deps` installs the
# `agent` extra's pinned dependencies (torch, NIXL, ...) into the agent's virtualenv on the CUDA base from
# pyproject.toml alone, and `agent-app` adds the wheel next to it, so a source change rebuilds megabytes,
# not the 6 GB of torch. The final
# stages copy a virtualenv and add nothing else: no compilers, no build tools, no pip cache, a numeric
# non-root user. Python dependency pins live in pyproject.toml only; base images are pinned here, by
# exact tag (tests/deploy/test_dockerfile.py checks all of this statically).
#
# In Kubernetes the probes are the chart's (operator: /healthz and /readyz on 8080) and the workload's
# (agent: /healthz and /readyz on 8471); HEALTHCHECK below serves plain `docker run`.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# torch 2.15 wheels are CUDA 13 builds (they bring their own CUDA libraries; the base brings the rest
# of the CUDA runtime and the driver integration of the NVIDIA container toolkit).
ARG CUDA_IMAGE=nvidia/cuda:13.2.0-runtime-ubuntu24.04

# ------------------------------------------------------------------ builder: wheel + operator venv
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpuobj ./gpuobj
COPY contract ./contract
COPY kube ./kube
COPY agent ./agent
COPY operator ./operator
RUN python -m pip wheel --no-deps --wheel-dir /dist .
# The operator never imports the data plane (torch, nixl, numpy; tests/deploy checks that): its venv
# gets the wheel's `operator` extra, whose dependencies pyproject.toml pins.
RUN python -m venv /opt/gpuobj \
 && /opt/gpuobj/bin/pip install --no-cache-dir "$(ls /dist/gpuobj-*.whl)[operator]" \
 && /opt/gpuobj/bin/python -m pip uninstall --yes pip \
 && /opt/gpuobj/bin/gpuobj operator --help > /dev/null

# ------------------------------------------------------------------ agent-requirements: the agent's pins, as a file
# Only the file goes on to agent-deps, so an edit of pyproject.toml that keeps the pins (tool
# settings, other extras) keeps the 6 GB dependency layer cached.
FROM ${PYTHON_IMAGE} AS agent-requirements
COPY pyproject.toml /src/pyproject.toml
RUN python3 -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; print(chr(10).join(p['dependencies'] + p['optional-dependencies']['agent']))" > /src/agent-requirements.txt

# ------------------------------------------------------------------ agent-deps: the agent extra's pinned dependencies
# Only the pin list comes in (agent-requirements, read from pyproject.toml: the one place pins live), so
# this layer (torch with its CUDA libraries: about 6 GB) is rebuilt when a pin changes, not when
# gpuobj's source or pyproject.toml's tool settings do. pip lives in its own venv (/opt/pip) and installs into /opt/gpuobj with --python, so
# the venv the images ship has no pip. The .pth file puts /opt/gpuobj-app (gpuobj itself, next stage)
# on that venv's path.
FROM ${CUDA_IMAGE} AS agent-deps
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY --from=agent-requirements /src/agent-requirements.txt /src/agent-requirements.txt
RUN python3 -m venv /opt/pip \
 && python3 -m venv --without-pip /opt/gpuobj \
 && /opt/pip/bin/pip --python /opt/gpuobj/bin/python install --no-cache-dir --requirement /src/agent-requirements.txt \
 && echo /opt/gpuobj-app > "$(/opt/gpuobj/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/gpuobj-app.pth"

# ------------------------------------------------------------------ agent-app: gpuobj itself, without dependencies
# Small and rebuilt on every source change; its console script runs the agent venv's interpreter.
FROM agent-deps AS agent-app
COPY --from=builder /dist /dist
RUN /opt/pip/bin/pip --python /opt/gpuobj/bin/python install --no-cache-dir --no-deps --target /opt/gpuobj-app "$(ls /dist/gpuobj-*.whl)" \
 && /opt/gpuobj-app/bin/gpuobj agent --help > /dev/null

# ------------------------------------------------------------------ agent-runtime: the CUDA base, python3 and the dependencies
# Its own stage so the 6 GB copy is a cached layer that a source change does not redo.
FROM ${CUDA_IMAGE} AS agent-runtime
ENV DEBIAN_FRONTEND=noninteractive
# Only the interpreter the venv links to (/usr/bin/python3, as in agent-deps); no -dev, no pip.
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 gpuobj \
 && useradd --system --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin gpuobj
COPY --from=agent-deps /opt/gpuobj /opt/gpuobj

# ------------------------------------------------------------------ agent: standalone agent, base of workload images
FROM agent-runtime AS agent
COPY --from=agent-app /opt/gpuobj-app /opt/gpuobj-app
ENV PATH=/opt/gpuobj-app/bin:/opt/gpuobj/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title="gpuobj-agent" \
      org.opencontainers.image.description="gpuobj agent: per-pod object store, NIXL, control server" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 65532:65532
EXPOSE 8471
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8471/healthz', timeout=4)"]
ENTRYPOINT ["gpuobj", "agent"]

# ------------------------------------------------------------------ operator (the default target)
FROM ${PYTHON_IMAGE} AS operator
RUN groupadd --system --gid 65532 gpuobj \
 && useradd --system --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin gpuobj
COPY --from=builder /opt/gpuobj /opt/gpuobj
ENV PATH=/opt/gpuobj/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title="gpuobj-operator" \
      org.opencontainers.image.description="gpuobj operator: frees GPU objects when out of scope" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 65532:65532
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('GPUOBJ_METRICS_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["gpuobj", "operator"]
