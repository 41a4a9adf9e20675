# syntax=docker/dockerfile:1.7
# OCR service image. Targets:
#   docker build --target gpu -t ocr-service:0.1.0-gpu .   # default: HunyuanOCR on vLLM 0.26.0 (CUDA wheels)
#   docker build --target cpu -t ocr-service:0.1.0-cpu .   # embedded engine (rapidocr/ONNX) only, no GPU stack
# No model weights are baked in: the Helm chart mounts them (model.volume) and sets OCR_MODEL. The same image runs
# the Ray head, the GPU workers and the KubeRay autoscaler sidecar (KubeRay replaces the command with `ray start`).

ARG PYTHON_VERSION=3.12
ARG DEBIAN_RELEASE=bookworm

# ---------------------------------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# tini reaps Ray's child processes; libgl/libglib are what OpenCV (rapidocr) loads at import.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini libgl1 libglib2.0-0 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 ocr \
 && useradd --uid 1000 --gid 1000 --home-dir /home/ocr --create-home --shell /usr/sbin/nologin ocr

# ---------------------------------------------------------------------------------------------------------------
# Dependencies first (cached while only the source changes), then the package itself without dependencies.
FROM base AS deps-cpu
WORKDIR /build
COPY pyproject.toml ./
RUN python -m venv "$VIRTUAL_ENV" \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
 && pip install -r requirements.txt

FROM deps-cpu AS deps-gpu
# vLLM pinned to the release run on the H200 (pyproject extra `vllm`); it brings its CUDA torch wheels.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['vllm']))" > requirements-vllm.txt \
 && grep -qx 'vllm==0.26.0' requirements-vllm.txt \
 && pip install -r requirements-vllm.txt

FROM deps-cpu AS app-cpu
COPY README.md ./
COPY service ./service
RUN pip install --no-deps . && rm -rf /build/*

FROM deps-gpu AS app-gpu
COPY README.md ./
COPY service ./service
RUN pip install --no-deps . && rm -rf /build/*

# ---------------------------------------------------------------------------------------------------------------
FROM base AS runtime
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG BUILD_DATE=unknown
LABEL org.opencontainers.image.title="ocr-service" \
      org.opencontainers.image.description="Horizontally scalable OCR API: HunyuanOCR on vLLM inside Ray Serve" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${BUILD_DATE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://example.invalid/ocr-service" \
      org.opencontainers.image.base.name="docker.io/library/python:3.12-slim-bookworm"
ENV OCR_HOST=0.0.0.0 \
    OCR_PORT=8000 \
    HOME=/home/ocr \
    RAY_USAGE_STATS_ENABLED=0 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
WORKDIR /home/ocr
EXPOSE 8000 8080 8265 6379
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["ocr-serve", "serve"]

# ---------------------------------------------------------------------------------------------------------------
FROM runtime AS cpu
COPY --from=app-cpu /opt/venv /opt/venv
ENV OCR_ENGINE=embedded
LABEL org.opencontainers.image.variant="cpu"
USER 1000:1000

# ---------------------------------------------------------------------------------------------------------------
FROM runtime AS gpu
# Triton compiles its small CUDA launcher with the system C compiler on first use.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=app-gpu /opt/venv /opt/venv
# VLLM_USE_V2_MODEL_RUNNER=0: vLLM 0.26's V1 runner. The V2 runner (vLLM's default for dense models) serves HunyuanOCR
# with our plugin's fix 5, but took 13 % longer per A4 token on the H200 (docs/DEPLOY.md, docs/BENCHMARKS.md).
ENV OCR_ENGINE=vllm \
    VLLM_USE_V2_MODEL_RUNNER=0 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_DO_NOT_TRACK=1
LABEL org.opencontainers.image.variant="gpu"
USER 1000:1000
