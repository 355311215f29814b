# everstep rollout image with the sglang engine (CUDA GPUs only). Build from the repository root:
#   docker build -f deploy/docker/rollout-sglang.Dockerfile -t everstep-rollout-sglang .
# sglang pins its own torch and transformers (deploy/sglang/requirements.txt), which conflict with the
# main environment's torch 2.13, so this image is separate from deploy/docker/rollout.Dockerfile.
# A CUDA devel base: flashinfer compiles some kernels at first use. Python >= 3.11 (Ubuntu 24.04: 3.12).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/tmp/hf \
    VIRTUAL_ENV=/opt/sglang PATH=/opt/sglang/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/sglang \
    && pip install --no-cache-dir --upgrade pip
WORKDIR /src
COPY deploy/sglang/requirements.txt deploy/sglang/requirements.txt
# sglang's pinned set first, so that nothing of ours moves it
RUN pip install --no-cache-dir -r deploy/sglang/requirements.txt
COPY common common
COPY services/rollout services/rollout
RUN pip install --no-cache-dir -c deploy/sglang/requirements.txt ./common ./services/rollout \
    && python -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" \
    && rm -rf /src \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin everstep
USER 10001:10001
WORKDIR /tmp
EXPOSE 9101 50051
ENTRYPOINT ["python", "-m", "everstep_rollout", "--engine", "sglang", "--device", "cuda"]
