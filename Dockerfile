# loraswap on a CUDA machine, serving $MODEL_ID (a Hub id or a mounted diffusers folder).
#   docker build -t loraswap .
#   docker run --gpus all -p 50051:50051 -e MODEL_ID=black-forest-labs/FLUX.1-dev \
#     -e HF_TOKEN=... -v $PWD/adapters:/adapters loraswap
# PyPI's torch 2.13.0 wheel for Linux x86-64 is the CUDA 13.0 build and brings its own CUDA, cuDNN and NCCL
# libraries (nvidia-* wheels): the base image only needs to match it, and the host a driver of 580 or later.
FROM nvidia/cuda:13.0.0-base-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
RUN python3 -m venv $VIRTUAL_ENV && pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir torch==2.13.0

WORKDIR /app
# Dependencies first, from the two pyproject files alone, so that editing the code does not reinstall them.
COPY client/pyproject.toml client/pyproject.toml
COPY server/pyproject.toml server/pyproject.toml
RUN python3 -c 'import tomllib; print("\n".join(r for side in ("client", "server") \
        for r in tomllib.load(open(f"{side}/pyproject.toml", "rb"))["project"]["dependencies"] \
        if not r.startswith("loraswap-")))' > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && python3 -c 'import torch, torchao; assert torch.version.cuda, "torch is not a CUDA build"'

# Then the contract and the code; --no-deps: everything they need is installed above.
COPY protos protos
COPY client client
COPY server server
RUN pip install --no-cache-dir --no-deps ./client ./server

# Run as an unprivileged user; the Hub cache lives in its home.
RUN useradd --create-home --uid 10001 loraswap && mkdir -p /adapters && chown loraswap /adapters
USER loraswap
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
    CMD python -m loraswap.server.healthcheck localhost:50051

CMD ["sh", "-c", "exec loraswap serve --model \"$MODEL_ID\""]
