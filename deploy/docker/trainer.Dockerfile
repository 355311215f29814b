# everstep trainer image (torch; CUDA wheels by default). Build from the repository root:
#   docker build -f deploy/docker/trainer.Dockerfile -t everstep-trainer .
# CPU-only: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE} AS build
RUN pip install --no-cache-dir --upgrade pip
WORKDIR /src
COPY common common
COPY services/trainer services/trainer
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./common ./services/trainer

FROM ${PYTHON_IMAGE}
# TORCH_SPEC: the torch to install (the Makefile's pin; the packages ask for torch>=2.6).
# TORCH_INDEX_URL: empty (the default) installs torch from PyPI (CUDA wheels); set, pip install --index-url it,
# e.g. https://download.pytorch.org/whl/cpu for CPU-only wheels. `make install TORCH_INDEX_URL=...` does the same.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/tmp/hf
# torch first, from the chosen index, so that no loose requirement pulls another build
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url ${TORCH_INDEX_URL}} "${TORCH_SPEC}"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin everstep
USER 10001:10001
WORKDIR /tmp
EXPOSE 9102 50052
ENTRYPOINT ["python", "-m", "everstep_trainer"]
