#!/usr/bin/env bash
# `make test` and `make test-stack`: the remaining installs, ruff and the tests that TEST_MARKERS (a pytest
# -m expression) selects; with PREBUILD_DEMO_MODEL=1 (`make test-stack`), the end-to-end tests' demo-model
# build started first.
#
# That build (tests/demo_model_build.py, minutes of CPU) is test-stack's critical path. Started here,
# in the background and in its own process group, it overlaps the installs and the other tests;
# pytest adopts it through EVERSTEP_TEST_DEMO_MODEL. It shares the CPU evenly with the installs and
# is lowered to nice 10 when the tests start, so that it never starves them. However this script
# ends, it kills that process group, and only it, and removes the build's folder.
set -euo pipefail
venv=${VENV:-.venv}
markers=${TEST_MARKERS:?TEST_MARKERS: the pytest -m expression of the tests to run}

model_dir=$(mktemp -d -t everstep-demo-model-XXXXXX)
build_pgid=
if [ "${PREBUILD_DEMO_MODEL:-0}" = 1 ]; then
    # setsid without --fork: the background child is no group leader, so it becomes one in place ($!).
    setsid "$venv/bin/python" tests/demo_model_build.py "$model_dir" >"$model_dir.log" 2>&1 &
    build_pgid=$!
fi
cleanup() {
    if [ -n "$build_pgid" ]; then kill -KILL -- "-$build_pgid" 2>/dev/null || true; fi
    rm -rf "$model_dir" "$model_dir.log" "$model_dir.toolchains.log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The sandbox toolchains (apt, npm: minutes on a fresh machine) install beside the pip installs; the two
# scripts' apt-get calls wait for each other's lock (DPkg::Lock::Timeout).
toolchains_log="$model_dir.toolchains.log"
make --no-print-directory VENV="$venv" "$venv/.installed-toolchains" >"$toolchains_log" 2>&1 &
toolchains_pid=$!
make --no-print-directory VENV="$venv" "$venv/.installed-dev" "$venv/.installed-deploy"
if ! wait "$toolchains_pid"; then
    cat "$toolchains_log" >&2
    exit 1
fi
"$venv/bin/ruff" check .
if [ -n "$build_pgid" ]; then
    renice -n 10 -g "$build_pgid" >/dev/null 2>&1 || true  # it may be done already
    export EVERSTEP_TEST_DEMO_MODEL="$model_dir"
fi
"$venv/bin/pytest" -q --timeout=900 --durations=30 -m "$markers" "$@"
