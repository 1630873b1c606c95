#!/usr/bin/env bash
# The image's Debian base, made here rather than pulled (no container registry is reachable
# from these machines): `debootstrap --variant=minbase` of one suite, trimmed as Debian's own
# -slim image is, brought up to the suite's security and point updates, and imported into
# podman's storage as one layer.
#
#   tools/container/base.sh TAG        # e.g. localhost/rhapsode-base:bookworm-<key>
#
# Pinned as far as the mirrors allow: deb.debian.org serves only each package's current
# version (and the snapshot archive is not reachable from here), so the versions cannot be
# forced; instead the base's package list is compared with tools/container/bookworm.lock and
# every difference printed.  RHAPSODE_BASE_STRICT=1 makes a difference fail the build;
# RHAPSODE_BASE_RELOCK=1 writes the list found into the lock file (a commit says why).
# An image already under TAG is kept: the Makefile's TAG carries a digest of this script and
# of the lock, so a change to either makes a new base.  Needs root, debootstrap and podman.
set -euo pipefail

tag=${1:?usage: base.sh TAG}
here=$(cd "$(dirname "$0")" && pwd)
suite=${RHAPSODE_BASE_SUITE:-bookworm}
mirror=${RHAPSODE_BASE_MIRROR:-http://deb.debian.org/debian}
security=${RHAPSODE_BASE_SECURITY:-http://deb.debian.org/debian-security}
lock=$here/$suite.lock

if podman image exists "$tag"; then
    echo "base: $tag exists; kept"
    exit 0
fi

work=$(mktemp -d "${TMPDIR:-/var/tmp}/rhapsode-base.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
started=$(date +%s)

echo "base: debootstrap --variant=minbase $suite from $mirror"
debootstrap --variant=minbase --components=main "$suite" "$root" "$mirror" > "$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    exit 1
}

# As Debian's -slim images: no documentation, manual pages or translations, now or from
# later installs (the copyright files stay: they are the licences).
cat > "$root/etc/dpkg/dpkg.cfg.d/rhapsode-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
EOF
cat > "$root/etc/apt/apt.conf.d/rhapsode-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
EOF
rm -f "$root/etc/apt/sources.list"
cat > "$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF

# The suite's updates and security fixes, which debootstrap does not take.
echo "base: apt-get upgrade from $suite-updates and $suite-security"
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    sh -c 'apt-get update -qq && apt-get -y -qq upgrade' > "$work/upgrade.log" 2>&1 || {
    tail -n 30 "$work/upgrade.log" >&2
    exit 1
}

chroot "$root" dpkg-query -W -f '${Package}=${Version}\n' | LC_ALL=C sort > "$work/packages"
if [ "${RHAPSODE_BASE_RELOCK:-0}" = 1 ]; then
    { echo "# $suite --variant=minbase, upgraded; written by tools/container/base.sh on $(date -u +%F)"
      cat "$work/packages"; } > "$lock"
    echo "base: wrote $lock"
elif [ -f "$lock" ]; then
    if ! diff <(grep -v '^#' "$lock") "$work/packages" > "$work/drift"; then
        echo "base: the mirror's versions differ from $lock (< locked, > found):"
        grep '^[<>]' "$work/drift" | sed 's/^/base:   /'
        if [ "${RHAPSODE_BASE_STRICT:-0}" = 1 ]; then
            echo "base: RHAPSODE_BASE_STRICT=1: refused" >&2
            exit 1
        fi
    else
        echo "base: every package at the version $lock pins"
    fi
fi

# What the run left that another run would not leave the same: apt's lists and caches,
# logs, the machine id (a container gets its own), Python-free so no bytecode.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
       "$root"/var/cache/debconf/*-old "$root"/var/cache/ldconfig/aux-cache "$root"/var/lib/dpkg/*-old "$root"/var/log/* \
       "$root"/usr/share/doc/*/changelog* "$root"/usr/share/man/* "$root"/usr/share/info/* \
       "$root"/tmp/* "$root"/var/tmp/*
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
find "$root/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
: > "$root/etc/machine-id"

digest=$(sha256sum "$work/packages" | cut -c1-16)
# Files in name order, none newer than SOURCE_DATE_EPOCH (default: bookworm's release day;
# a package's files keep the times its .deb gave them), so the same tree gives the same layer.
epoch=${SOURCE_DATE_EPOCH:-1686355200}
tar -C "$root" --sort=name --numeric-owner --mtime="@$epoch" --clamp-mtime --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    -cf "$work/root.tar" .
podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --change "LABEL org.opencontainers.image.description=\"Debian $suite minbase for Rhapsode\" io.rhapsode.base.packages=$digest" \
    --quiet --message "debootstrap --variant=minbase $suite" \
    "$work/root.tar" "$tag" > /dev/null
echo "base: $tag imported in $(( $(date +%s) - started )) s ($(du -sm "$work/root.tar" | cut -f1) MB)"
