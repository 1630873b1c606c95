#!/usr/bin/env bash
# `make image`: the image's two tags built from this checkout with podman (the tests build
# through this same script, so they test what it makes).
#
#   tools/container/build.sh [core|engines|all]      # default: all
#
#   localhost/rhapsode:VERSION          and :latest    the core and the SDK (--target core)
#   localhost/rhapsode:VERSION-engines  and :engines   with tone, espeak and piper installed
#
# RHAPSODE_IMAGE_BASE names the base (debian:bookworm-slim, python:3.11-slim, a CUDA image);
# without it the base is made here by tools/container/base.sh, once, and kept in podman's
# storage under a tag that changes only when that script or its lock file does.
# RHAPSODE_IMAGE_SUFFIX goes after every tag (`make image-gpu`: -cuda, so :VERSION-cuda, :cuda).
# RHAPSODE_IMAGE_CA is a CA bundle handed to the build as the secret `hostca` (default: this
# machine's /etc/ssl/certs/ca-certificates.crt, which is what reaches PyPI from here, through
# the TLS-intercepting egress proxy); RHAPSODE_IMAGE_CA=none hands none.  pip's cache is a
# cache mount outside the tree (where the index's answers allow caching: here they do not).
set -euo pipefail

which=${1:-all}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
version=$(sed -n 's/^version *= *//p' setup.cfg | head -n 1)

# shellcheck source=tools/container/podman-flags.sh
. tools/container/podman-flags.sh

if [ -n "${RHAPSODE_IMAGE_BASE:-}" ]; then
    base=$RHAPSODE_IMAGE_BASE
else
    key=$(cat tools/container/base.sh tools/container/bookworm.lock | sha256sum | cut -c1-12)
    base=localhost/rhapsode-base:bookworm-$key
    tools/container/base.sh "$base"
fi

ca=${RHAPSODE_IMAGE_CA:-/etc/ssl/certs/ca-certificates.crt}
secret=()
if [ "$ca" != none ] && [ -s "$ca" ]; then
    secret=(--secret "id=hostca,src=$ca")
fi

build() {
    local target=$1; shift
    local started; started=$(date +%s)
    # The docker format keeps HEALTHCHECK, which the OCI format has no field for.
    podman build "${RHAPSODE_PODMAN_FLAGS[@]}" --format docker --layers \
        "${secret[@]}" --build-arg "BASE=$base" --target "$target" \
        --label "org.opencontainers.image.revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
        "$@" -f Containerfile . >&2
    echo "image: $target built in $(( $(date +%s) - started )) s: $(podman image inspect --format '{{.Size}}' "${@: -1}" | awk '{printf "%.0f MB", $1 / 1e6}')" >&2
}

suffix=${RHAPSODE_IMAGE_SUFFIX:-}
moving=latest
[ -z "$suffix" ] || moving=${suffix#-}
case $which in
    core|all) build core -t "localhost/rhapsode:$moving" -t "localhost/rhapsode:$version$suffix" ;;
esac
case $which in
    engines|all) build engines -t "localhost/rhapsode:engines$suffix" -t "localhost/rhapsode:$version-engines$suffix" ;;
esac
# What earlier builds of these tags left behind, untagged (never another project's images).
podman image prune -f --filter "label=org.opencontainers.image.title=rhapsode" > /dev/null
