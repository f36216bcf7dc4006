# syntax=docker/dockerfile:1.7
# Two images from one file:
#   docker build --target operator -t ghcr.io/vexpert/vexpert-operator:0.1.0 .  # slim Python, no torch
#   docker build --target runtime  -t ghcr.io/vexpert/vexpert-runtime:0.1.0  .  # CUDA PyTorch, `vexpert` entrypoint
# Base images are pinned to exact version tags (override with --build-arg); pin digests in your
# registry mirror for bit-for-bit reproducibility. Both images run as UID/GID 10001.
# Checked by tests/test_dockerfile.py (hadolint, no warnings; operator target without torch).

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG TORCH_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

# ---------------------------------------------------------------------------------------------
# Build the wheel once (pure Python); both targets install it.
FROM ${PYTHON_IMAGE} AS wheel
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
RUN pip install --no-cache-dir build==1.2.2 \
    && python -m build --wheel --outdir /dist \
    && test "$(find /dist -name 'vexpert-*.whl' | wc -l)" -eq 1

# ---------------------------------------------------------------------------------------------
# The operator: kopf + kubernetes client (the `operator` extra), no torch. Read-only root
# filesystem friendly: no bytecode writes, nothing written at run time.
FROM ${PYTHON_IMAGE} AS operator
LABEL org.opencontainers.image.title="vexpert-operator" \
      org.opencontainers.image.description="vExpert Kubernetes operator (kopf)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /dist /dist
RUN pip install --no-cache-dir "$(find /dist -name 'vexpert-*.whl')[operator]" \
    && rm -rf /dist \
    && groupadd --gid 10001 vexpert \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin vexpert
USER 10001:10001
# 8080: /metrics, 8081: kopf liveness (/healthz)
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "vexpert_operator"]

# ---------------------------------------------------------------------------------------------
# The node runtime: coordinator, workers, allocator, calibration (`vexpert ...`).
FROM ${TORCH_IMAGE} AS runtime
LABEL org.opencontainers.image.title="vexpert-runtime" \
      org.opencontainers.image.description="vExpert node runtime and calibration (CUDA PyTorch)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/vexpert
COPY --from=wheel /dist /dist
# torch comes from the base image; the rest of the `runtime` extra is named here so that pip does not
# replace the image's CUDA build of torch (tests/test_dockerfile.py keeps this list and the extra equal).
RUN pip install --no-cache-dir "$(find /dist -name 'vexpert-*.whl')" "safetensors>=0.4" "numpy>=1.26" \
        "transformers==5.17.0" "aiohttp>=3.9" "llguidance>=1.7" "huggingface-hub>=1.5,<2" \
    && rm -rf /dist \
    && groupadd --gid 10001 vexpert \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/vexpert --shell /usr/sbin/nologin vexpert
USER 10001:10001
WORKDIR /home/vexpert
# 8000: `vexpert serve` (OpenAI API, /health, /metrics; the operator's runtime.httpPort), 9400: `vexpert node`
# /metrics and /ready (runtime.metrics_port), 29500: group rendezvous
EXPOSE 8000 9400 29500
ENTRYPOINT ["vexpert"]
CMD ["--help"]
