#!/usr/bin/env bash
# A base image for `make image` made without an image registry: Debian bookworm's minbase with
# Python 3.11 from Debian's packages (mmdebstrap), imported into podman as $TAG.
#
#   scripts/image_base.sh [TAG]      default localhost/baton-base:bookworm
#
# The rootfs is cached (~/.cache/baton-image, or $BATON_IMAGE_CACHE) and the image is kept in
# podman's store, so only the first run on a machine takes mmdebstrap's ~30 s. Remove both to
# take Debian's updates: rm -r ~/.cache/baton-image; podman rmi TAG.
set -euo pipefail
tag=${1:-localhost/baton-base:bookworm}
cache=${BATON_IMAGE_CACHE:-$HOME/.cache/baton-image}
rootfs=$cache/bookworm-minbase-python3.tar

if podman image exists "$tag"; then
    echo "$tag: already in podman's store"
    exit 0
fi
if [ ! -s "$rootfs" ]; then
    mkdir -p "$cache"
    # Documentation, manuals and translations are left out (~45 MB): nothing here reads them.
    mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --format=tar bookworm "$rootfs.part" >&2
    mv "$rootfs.part" "$rootfs"
fi
podman import --change 'CMD ["python3"]' "$rootfs" "$tag" >/dev/null
echo "$tag: imported from $rootfs"
