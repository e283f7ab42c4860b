# loraswap, serving $MODEL_ID (a Hub id or a mounted diffusers folder). On a CUDA machine:
#   docker build -t loraswap .
#   docker run --gpus all -p 50051:50051 --stop-timeout 40 -e MODEL_ID=black-forest-labs/FLUX.1-dev \
#     -e HF_TOKEN=... -v $PWD/adapters:/adapters loraswap
# (--stop-timeout: the server drains for up to LORASWAP_GRACE_SECONDS, 30 s, before it exits; Docker waits 10.)
# On a CPU, the same file on a Debian or Ubuntu base with a CPU torch (README, "The container image"):
#   docker build --build-arg BASE_IMAGE=debian:bookworm --build-context wheels=DIR_WITH_A_CPU_TORCH_WHEEL \
#     --build-arg TORCH_SPEC=torch==2.13.0+cpu -t loraswap:cpu .
# PyPI's torch 2.13.0 wheel for Linux x86-64 is the CUDA 13.0 build and brings its own CUDA, cuDNN and NCCL
# libraries (nvidia-* wheels): the CUDA base image only needs to match it, and the host a driver of 580 or later.
ARG BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

# Wheels pip looks in before PyPI, mounted for the build only: empty unless `--build-context wheels=DIR` names some.
FROM scratch AS wheels

FROM ${BASE_IMAGE}

# No versions: each BASE_IMAGE's release has its own (Ubuntu 24.04's for CUDA, Debian's or Ubuntu's for a CPU), so one
# pin cannot fit them all, and within a release these packages only get fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && apt-get clean && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
# Behind a TLS-intercepting proxy, pip must trust its CA: pass the bundle as a build secret (never a layer) with
# `--secret id=ca-bundle,src=BUNDLE --build-arg PIP_CERT=/run/secrets/ca-bundle`. Unset, pip trusts its own.
ARG PIP_CERT
ARG TORCH_SPEC=torch==2.13.0
# hadolint cannot read a pin inside a build argument; TORCH_SPEC is one (torch==VERSION, torch==VERSION+cpu).
# hadolint ignore=DL3013
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=ca-bundle \
    python3 -m venv $VIRTUAL_ENV && pip install --no-cache-dir pip==26.3 \
    && pip install --no-cache-dir --find-links /wheels "$TORCH_SPEC"

WORKDIR /app
# Dependencies first, from the two pyproject files alone, so that editing the code does not reinstall them.
COPY client/pyproject.toml client/pyproject.toml
COPY server/pyproject.toml server/pyproject.toml
RUN --mount=type=secret,id=ca-bundle python3 -c 'import tomllib; print("\n".join(r for side in ("client", "server") \
        for r in tomllib.load(open(f"{side}/pyproject.toml", "rb"))["project"]["dependencies"] \
        if not r.startswith("loraswap-")))' > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && python3 -c 'import os, torch, torchao; \
        assert torch.version.cuda or "CUDA_VERSION" not in os.environ, "a CUDA base image but a CPU torch"'

# Then the contract and the code; --no-deps: everything they need is installed above (the build backends still come
# from PyPI).
COPY protos protos
COPY client client
COPY server server
RUN --mount=type=secret,id=ca-bundle pip install --no-cache-dir --no-deps ./client ./server

# Run as an unprivileged user; the Hub cache lives in its home. USER by number, so that a runtime that checks
# "not root" before starting it (Kubernetes' runAsNonRoot) can tell without the image's /etc/passwd.
RUN groupadd --gid 10001 loraswap && useradd --create-home --uid 10001 --gid 10001 loraswap \
    && mkdir -p /adapters && chown loraswap:loraswap /adapters
USER 10001:10001
ENV HF_HOME=/home/loraswap/.cache/huggingface

ENV MODEL_ID=black-forest-labs/FLUX.1-dev \
    LORASWAP_ADAPTER_DIR=/adapters \
    LORASWAP_PORT=50051 \
    LORASWAP_COMPILE=true
VOLUME ["/adapters"]
EXPOSE 50051

# Start-up loads, compiles and warms the model before SERVING: give it time. A server run with --tls-cert/--tls-key
# needs the probe to speak TLS: add `--tls-ca /path/ca.pem`, `--tls-server-name NAME` when the certificate is
# not made for localhost, and `--tls-cert/--tls-key` under --tls-client-ca.
HEALTHCHECK --interval=15s --timeout=10s --start-period=900s --retries=3 \
    CMD ["python", "-m", "loraswap.server.healthcheck", "localhost:50051"]

CMD ["sh", "-c", "exec loraswap serve --model \"$MODEL_ID\""]
