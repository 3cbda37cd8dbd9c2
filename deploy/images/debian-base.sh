#!/usr/bin/env bash
# A Python base image made from Debian's archive, for machines that cannot pull from a registry
# (air-gapped sites, CI without registry access). The result is a drop-in BASE for deploy/Dockerfile.
#
#   sudo bash deploy/images/debian-base.sh [TAG]          # default TAG: elasticctl-base:bookworm
#   docker build -f deploy/Dockerfile --build-arg BASE=elasticctl-base:bookworm ...
#
# Needs root, mmdebstrap and a Docker engine; uses this host's apt sources (and its mirror or proxy).
# tini is included so the image build needs no apt of its own. SUITE=trixie picks another release.
set -euo pipefail

tag="${1:-elasticctl-base:bookworm}"
suite="${SUITE:-bookworm}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# python3-venv brings ensurepip (pip inside every venv); passwd brings useradd; tini is PID 1.
mmdebstrap --quiet --variant=apt --include=python3,python3-venv,ca-certificates,passwd,tini \
    "$suite" "$work/rootfs.tar"
docker import \
    --change "LABEL org.elasticctl.recipe=$(sha256sum "$0" | cut -c1-16)" \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "Debian $suite with python3, python3-venv and tini (deploy/images/debian-base.sh)" \
    "$work/rootfs.tar" "$tag" > /dev/null
echo "$tag"
