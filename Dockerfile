# transformers-openai-api as a container: `python -m transformers_openai.main`, every setting an environment
# variable (MODEL / HF_MODEL, DTYPE / TORCH_DTYPE, MAX_BATCH_SIZE, API_KEY, ...; see docs/deployment.md); arguments
# after the image name are appended as flags. With no model named it serves the README's quick-start model
# (SmolLM2-135M-Instruct, with its tools template): deploy/entrypoint.py.
#
# GPU (default): torch from PyPI, whose Linux wheels are the CUDA build (the CUDA libraries come as pip packages;
# the host needs the NVIDIA driver and Container Toolkit only).
#   docker build -t transformers-openai-api .
#   docker run --gpus all -p 7088:7088 -v hf-cache:/data/huggingface -e HF_MODEL=Qwen/Qwen2.5-0.5B-Instruct \
#     transformers-openai-api --max-batch-size 32
# CPU: the same torch version from PyTorch's CPU index (about 200 MB instead of several GB).
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t transformers-openai-api:cpu .
ARG BASE_IMAGE=python:3.12-slim-bookworm
FROM ${BASE_IMAGE}

# The torch the tests run on; scripts/env.sh installs the same (tests/deploy keeps the two equal).
ARG TORCH_SPEC=torch==2.13.0
# Empty: PyPI (CUDA build). https://download.pytorch.org/whl/cpu: the CPU build.
ARG TORCH_INDEX=
# 1000 is the usual first desktop user, so a bind-mounted host cache stays writable.
ARG APP_UID=1000

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN python -m pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "${TORCH_SPEC}"
# The CPU image compiles its decode step at start (CPU_COMPILE): torch.compile builds C++ kernels with g++.
RUN case "${TORCH_INDEX}" in *cpu*) apt-get update && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/* ;; esac

WORKDIR /tmp/src
COPY pyproject.toml README.md ./
COPY transformers_openai ./transformers_openai
# A regular (not editable) install, so the source tree is not needed at run time; the entry command is tried
# from / so that it runs the installed package.
RUN python -m pip install ".[gguf,quantization]" \
    && cd / \
    && python -m transformers_openai.main --help >/dev/null \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    && rm -rf /tmp/src

# The entry point finds the chat templates beside itself.
COPY deploy/healthcheck.py deploy/entrypoint.py /usr/local/lib/transformers-openai/
COPY deploy/chat-templates /usr/local/lib/transformers-openai/chat-templates

# --non-unique: some bases already have a user with this uid.
RUN useradd --create-home --non-unique --uid "${APP_UID}" --user-group app \
    && mkdir -p /data/huggingface \
    && chown -R app:app /data

# Compiled decode steps (CPU_COMPILE) are kept in the same volume as the models: a new container loads them.
ENV HF_HOME=/data/huggingface \
    COMPILE_CACHE_DIR=/data/huggingface/compiled-steps \
    TOKENIZERS_PARALLELISM=false \
    HOST=0.0.0.0 \
    PORT=7088

# Downloaded models live here: mount a named volume (or a host directory) to keep them across containers.
VOLUME ["/data/huggingface"]

USER app
WORKDIR /home/app
EXPOSE 7088

# /health answers 503 while the model loads; the start period covers a first download.
HEALTHCHECK --interval=30s --timeout=5s --start-period=15m --retries=3 \
    CMD ["python", "/usr/local/lib/transformers-openai/healthcheck.py"]

ENTRYPOINT ["python", "/usr/local/lib/transformers-openai/entrypoint.py"]
