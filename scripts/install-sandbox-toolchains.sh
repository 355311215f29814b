#!/usr/bin/env bash
# Installs what the sandbox service runs programs with: bubblewrap (isolation) and the toolchains of
# its 13 languages, from Debian packages and npm only. Idempotent and fast when everything is there:
# it installs only the packages whose command is missing, and runs `apt-get update` only then.
# Usage: bash scripts/install-sandbox-toolchains.sh   (as root, or with sudo available)
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
)

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

if ((${#missing[@]})); then
    mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)
    echo "install-sandbox-toolchains: installing ${packages[*]}" >&2
    $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi

if ! command -v tsc >/dev/null 2>&1 || [[ ! -f "$(npm root -g)/typescript/package.json" ]]; then
    echo "install-sandbox-toolchains: installing typescript (npm)" >&2
    $SUDO npm install -g --silent typescript@5 >/dev/null
fi

for command in bwrap gcc g++ java javac go rustc node tsc ruby php perl lua5.4 bash python3; do
    command -v "$command" >/dev/null 2>&1 || { echo "install-sandbox-toolchains: $command still missing" >&2; exit 1; }
done
echo "install-sandbox-toolchains: all sandbox toolchains present" >&2
