# everstep sandbox image (no torch): the service plus bubblewrap and the toolchains and runtime
# libraries of its languages, installed by the same script `make test` uses, with --all (the heavy
# toolchains too: Mono, Racket, Kotlin). Build from the repository root:
#   docker build -f deploy/docker/sandbox.Dockerfile -t everstep-sandbox .
#
# Runs as root on purpose: it creates namespaces with bubblewrap, drops every run to a per-slot
# unprivileged uid and writes its own cgroups. The pod needs what docs/sandbox.md lists
# (CAP_SYS_ADMIN or privileged, seccomp/AppArmor unconfined for bwrap, a writable cgroup
# namespace); user code itself never runs as root.
FROM python:3.11-slim-bookworm AS build
RUN pip install --no-cache-dir --upgrade pip
WORKDIR /src
COPY common common
COPY services/sandbox services/sandbox
# wheels of the shared package (everstep-common), this service and their dependencies only
RUN pip wheel --no-cache-dir --wheel-dir /wheels ./common ./services/sandbox

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 DEBIAN_FRONTEND=noninteractive
COPY scripts/install-sandbox-toolchains.sh /tmp/install-sandbox-toolchains.sh
RUN bash /tmp/install-sandbox-toolchains.sh --all \
    && rm -rf /var/lib/apt/lists/* /root/.npm /tmp/install-sandbox-toolchains.sh
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels everstep-common everstep-sandbox \
    && rm -rf /wheels \
    && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch in a torch-free image'"
WORKDIR /tmp
EXPOSE 8080 50055
HEALTHCHECK CMD python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"
ENTRYPOINT ["python", "-m", "everstep_sandbox", "--host", "0.0.0.0", "--port", "8080", "--grpc-port", "50055"]
