#!/usr/bin/env bash
# Installs what the sandbox service runs programs with: bubblewrap and libseccomp2 (isolation; the sandbox's
# pyseccomp loads libseccomp.so.2 and refuses to start without it), the toolchains of its
# languages, the runtime libraries graders import (numpy, pandas, scipy, sympy, networkx,
# sortedcontainers, requests, lodash, javatuples, Test::Deep, Data::Compare, Go's testify) and
# ipykernel with matplotlib (POST /run_jupyter, whose plots come back as image/png), from Debian
# packages and npm only, and go_test's build-cache seed (testify precompiled). With --all (the image)
# also the heavy toolchains of csharp (Mono), racket and kotlin_script, which `make test` leaves out to stay
# within its 15 minutes (about 115 s of installs and 700 MB; see docs/sandbox.md). Idempotent and
# fast when everything is there: it installs only the packages whose command, file or package is
# missing, and runs `apt-get update` only then. The npm installs run while apt works.
# Usage: bash scripts/install-sandbox-toolchains.sh [--all]   (as root, or with sudo available)
set -euo pipefail
# The sandbox sees only system directories: look for tools there, not in ~/.cargo or ~/.pyenv.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    SUDO="sudo"
fi

# command → Debian package that provides it.
declare -A DEBIAN_PACKAGE=(
    [bwrap]=bubblewrap
    [gcc]=gcc
    [g++]=g++
    [java]=default-jdk-headless
    [javac]=default-jdk-headless
    [go]=golang-go
    [rustc]=rustc
    [node]=nodejs
    [npm]=npm
    [ruby]=ruby
    [php]=php-cli
    [perl]=perl
    [lua5.4]=lua5.4
    [bash]=bash
    [python3]=python3
    [scalac]=scala
    [Rscript]=r-base-core
    [ldc2]=ldc
    [iverilog]=iverilog
    [vvp]=iverilog
    [sqlite3]=sqlite3
)

if [[ ${1:-} == --all ]]; then
    DEBIAN_PACKAGE+=([mcs]=mono-mcs [mono]=mono-runtime [racket]=racket [kotlinc]=kotlin)
elif [[ -n ${1:-} ]]; then
    echo "usage: $0 [--all]" >&2
    exit 2
fi

# Debian packages without a command of their own (libraries, jars), checked by package name.
LIBRARY_PACKAGES=(
    python3-numpy python3-pandas python3-scipy python3-sympy python3-networkx python3-sortedcontainers
    python3-requests python3-pytest python3-ipykernel node-lodash libjavatuples-java junit5
    libtest-deep-perl libdata-compare-perl golang-github-stretchr-testify-dev python3-matplotlib
    libseccomp2
)

# npm packages (global), installed in the background while apt-get runs.
npm_pids=()
npm_root=""
npm_missing() {
    [[ -n $npm_root ]] || npm_root=$(npm root -g 2>/dev/null) || true
    [[ ! -f "$npm_root/$1/package.json" ]]
}
start_npm_install() {  # package spec, module name
    if command -v npm >/dev/null 2>&1 && npm_missing "$2"; then
        echo "install-sandbox-toolchains: installing $1 (npm)" >&2
        $SUDO npm install -g --silent "$1" >/dev/null &
        npm_pids+=($!)
    fi
}
start_npm_install typescript@5 typescript
start_npm_install jest@29 jest

missing=()
for command in "${!DEBIAN_PACKAGE[@]}"; do
    if ! command -v "$command" >/dev/null 2>&1; then
        # npm ships with nodejs from other sources (nodesource); do not pull Debian's npm over it.
        if [[ $command == npm ]] && command -v node >/dev/null 2>&1 && [[ -x "$(dirname "$(command -v node)")/npm" ]]; then
            continue
        fi
        missing+=("${DEBIAN_PACKAGE[$command]}")
    fi
done
for package in "${LIBRARY_PACKAGES[@]}"; do
    if [[ "$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null)" != "install ok installed" ]]; then
        missing+=("$package")
    fi
done

if ((${#missing[@]})); then
    mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)
    echo "install-sandbox-toolchains: installing ${packages[*]}" >&2
    # flock: `make test` runs this beside install-deploy-tools.sh, and a second `apt-get update` does not
    # wait for the lists lock (DPkg::Lock::Timeout covers only dpkg's)
    $SUDO flock /tmp/everstep-apt.lock apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO flock /tmp/everstep-apt.lock apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends "${packages[@]}" >/dev/null
fi

for pid in "${npm_pids[@]}"; do
    wait "$pid"
done
npm_pids=()
# npm came with apt just now (a fresh machine): its installs could not start before.
start_npm_install typescript@5 typescript
start_npm_install jest@29 jest
for pid in "${npm_pids[@]}"; do
    wait "$pid"
done

# go_test's build-cache seed (GO_CACHE_SEED in services/sandbox/everstep_sandbox/languages/base.py): testify
# and `testing` compiled and vetted with the sandbox's Go environment (GO_ENV there), so that a test importing
# testify does not spend ~15 s of its run compiling it (and net/http) into its empty cache. Built again
# when the Go version changes.
GO_CACHE_SEED=/usr/local/lib/everstep-sandbox/go-build
go_stamp="$GO_CACHE_SEED/everstep-$(go version | tr -c 'A-Za-z0-9.\n' _)"
if [[ ! -f $go_stamp ]]; then
    echo "install-sandbox-toolchains: building go_test's build-cache seed" >&2
    seed_dir=$(mktemp -d)
    printf '%s\n' 'package main' 'import (' '"testing"' '"github.com/stretchr/testify/assert"' \
        '"github.com/stretchr/testify/require"' ')' \
        'func TestSeed(t *testing.T) { require.NotNil(t, t); assert.Equal(t, 2, 1+1) }' > "$seed_dir/seed_test.go"
    (cd "$seed_dir" && env -i PATH="$PATH" HOME="$seed_dir" GOCACHE="$seed_dir/go-build" \
        GOPATH=/tmp/go:/usr/share/gocode GO111MODULE=off CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
        go test -count=1 seed_test.go >/dev/null)
    touch "$seed_dir/go-build/$(basename "$go_stamp")"
    chmod -R a+rX "$seed_dir/go-build"
    $SUDO mkdir -p "$(dirname "$GO_CACHE_SEED")"
    $SUDO rm -rf "$GO_CACHE_SEED"
    $SUDO cp -r "$seed_dir/go-build" "$GO_CACHE_SEED"
    rm -rf "$seed_dir"
fi

for command in "${!DEBIAN_PACKAGE[@]}" tsc; do
    command -v "$command" >/dev/null 2>&1 || { echo "install-sandbox-toolchains: $command still missing" >&2; exit 1; }
done
for module in typescript jest; do
    npm_missing "$module" && { echo "install-sandbox-toolchains: npm's $module still missing" >&2; exit 1; }
done
echo "install-sandbox-toolchains: all sandbox toolchains present" >&2
