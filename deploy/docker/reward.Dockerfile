# everstep reward image (no torch). Build from the repository root:
#   docker build -f deploy/docker/reward.Dockerfile -t everstep-reward .
FROM python:3.11-slim AS build
RUN pip install --no-cache-dir --upgrade pip
WORKDIR /src
COPY common common
COPY services/reward services/reward
# wheels of the shared package (everstep-common), this service and their dependencies only
RUN pip wheel --no-cache-dir --wheel-dir /wheels ./common ./services/reward

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels everstep-common everstep-reward \
    && rm -rf /wheels \
    && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch in a torch-free image'" \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin everstep
USER 10001:10001
WORKDIR /tmp
EXPOSE 9104 50054
ENTRYPOINT ["python", "-m", "everstep_reward"]
