# syntax=docker/dockerfile:1.7
# Two images from one file:
#   docker build --target operator -t vexpert-operator:0.1.0 .   # slim Python, no torch
#   docker build --target runtime  -t vexpert-runtime:0.1.0  .   # CUDA PyTorch, `vexpert` entrypoint
# Base images are pinned to exact versions; pin digests in your registry mirror for reproducibility.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG TORCH_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

# ---------------------------------------------------------------------------------------------
# Build the wheel once (pure Python); both targets install it.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
RUN pip install --no-cache-dir build==1.2.2 && python -m build --wheel --outdir /dist

# ---------------------------------------------------------------------------------------------
# The operator: kopf + kubernetes client, no torch.
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY --from=wheel /dist /dist
RUN pip install --no-cache-dir "$(ls /dist/vexpert-*.whl)[operator]" && rm -rf /dist \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin vexpert
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["python", "-m", "vexpert_operator"]

# ---------------------------------------------------------------------------------------------
# The node runtime: coordinator, workers, allocator, calibration (`vexpert ...`).
FROM ${TORCH_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY --from=wheel /dist /dist
# torch comes from the base image; the `runtime` extra adds safetensors and numpy only.
RUN pip install --no-cache-dir "$(ls /dist/vexpert-*.whl)" "safetensors>=0.4" "numpy>=1.26" && rm -rf /dist \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin vexpert
USER 10001:10001
EXPOSE 9400
ENTRYPOINT ["vexpert"]
CMD ["--help"]
