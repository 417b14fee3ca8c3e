#!/usr/bin/env bash
# Build the gpuwatch agent image from Debian packages and the gpuwatch wheel, without pulling
# any base image from a registry.
#
#   bash deploy/image/build.sh rootfs   # only the root filesystem (cached); prints its path
#   bash deploy/image/build.sh image    # rootfs -> OCI layout + docker-archive tarball
#   bash deploy/image/build.sh ref      # prints the image reference the manifests use
#
# How (as root; apt-get install mmdebstrap umoci skopeo):
#   1. base: mmdebstrap makes a Debian root filesystem from deploy/image/packages.txt
#      (variant "essential": no apt, no compiler; BCC's clang/LLVM come as libraries), and a
#      hook unpacks Debian's kernel headers into /opt/gpuwatch/bundled-kernel-headers
#      (deploy/image/bundle-kernel-headers.sh: for hosts without headers; not installed as
#      packages, which would pull gcc in).
#   2. app: the gpuwatch wheel is built from this checkout, its dependencies are fetched as
#      wheels by the host's pip (so its index/mirror configuration applies), and both are
#      installed --no-index into a venv at /opt/gpuwatch/venv inside the rootfs (a venv made
#      with --system-site-packages: it sees Debian's bcc). The probes' C sources (bpf/) go
#      where the installed package looks for them.
#   3. image: umoci turns the base and the venv into two OCI layers plus the image config
#      (entrypoint gpuwatch, cmd agent); skopeo writes a docker-archive that `docker load`,
#      `podman load`, `ctr -n k8s.io images import` and `kind load image-archive` read.
#
# Both rootfs stages are cached under $GPUWATCH_IMAGE_CACHE (default /var/cache/gpuwatch/image):
# the base keyed by the package list, suite and mirror; the app keyed by the base key plus
# the hashes of the wheels' contents (file names and bytes, not zip timestamps). A repeated
# build with nothing changed takes seconds. Old cache entries are pruned (newest 2 kept).
#
# Environment: GPUWATCH_IMAGE_SUITE (bookworm), GPUWATCH_IMAGE_MIRROR (http://deb.debian.org/debian),
# GPUWATCH_IMAGE_SECURITY_MIRROR (http://deb.debian.org/debian-security), GPUWATCH_IMAGE_CACHE,
# GPUWATCH_IMAGE_OUT (image output dir, default <repo>/dist/image), PYTHON (host python3 with pip),
# GPUWATCH_IMAGE_GIT_REF (build gpuwatch from this git revision instead of the working tree).
set -euo pipefail

mode="${1:-}"
case "$mode" in rootfs|image|ref) ;; *)
  echo "usage: bash deploy/image/build.sh rootfs|image|ref" >&2; exit 2 ;;
esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
suite="${GPUWATCH_IMAGE_SUITE:-bookworm}"
mirror="${GPUWATCH_IMAGE_MIRROR:-http://deb.debian.org/debian}"
security_mirror="${GPUWATCH_IMAGE_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
cache="${GPUWATCH_IMAGE_CACHE:-/var/cache/gpuwatch/image}"
out="${GPUWATCH_IMAGE_OUT:-$repo/dist/image}"
python="${PYTHON:-/usr/bin/python3}"
venv=/opt/gpuwatch/venv
bundled_headers=/opt/gpuwatch/bundled-kernel-headers  # gpuwatch/probes/bcc_loader.py: BUNDLED_HEADERS
# Bump when the recipe below changes in a way the keys do not see.
recipe=2

log() { printf '[gpuwatch image] %s\n' "$*" >&2; }
die() { printf '[gpuwatch image] error: %s\n' "$1" >&2; [ -n "${2:-}" ] && printf '  fix: %s\n' "$2" >&2; exit 1; }

version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$repo/pyproject.toml" | head -n 1)"
[ -n "$version" ] || die "no version in $repo/pyproject.toml" "add version = \"x.y.z\" under [project]"
image_name="localhost/gpuwatch"
image_ref="$image_name:$version"
if [ "$mode" = ref ]; then echo "$image_ref"; exit 0; fi

[ "$(id -u)" -eq 0 ] || die "building the image needs root (mmdebstrap in root mode, chroot)" \
  "sudo bash deploy/image/build.sh $mode"
need() { command -v "$1" >/dev/null 2>&1 || die "\`$1\` not found" "apt-get install $2"; }
need mmdebstrap mmdebstrap
need unshare util-linux
"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip" "apt-get install python3-pip, or set PYTHON"

mapfile -t packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$here/packages.txt" | grep -v '^$' | sort -u)
[ "${#packages[@]}" -gt 0 ] || die "$here/packages.txt lists no packages"
sources=("deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security_mirror $suite-security main")

sha() { sha256sum | cut -c1-16; }
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9  # one build at a time (tests running in parallel share the cache)

# Keep the newest $2 entries matching $1-* (by mtime); remove the rest, but never one that is
# mounted (e.g. a test's overlay has it as its lower layer right now).
prune() {
  local old
  while IFS= read -r old; do
    [ -n "$old" ] || continue
    if grep -qF "$old/" /proc/self/mountinfo; then
      log "keeping old cache entry $old: in use by a mount"
      continue
    fi
    log "pruning old cache entry $old"
    rm -rf --one-file-system "$old"
  done < <(ls -1dt "$cache/$1"-* 2>/dev/null | tail -n +"$(($2 + 1))")
}

# --- 1. Debian base --------------------------------------------------------------------------
base_key="$(printf '%s\n' "recipe=$recipe" "suite=$suite" "${sources[@]}" "${packages[@]}" \
  "headers=$bundled_headers $(sha <"$here/bundle-kernel-headers.sh")" | sha)"
base="$cache/base-$base_key"
if [ ! -e "$base/.complete" ]; then
  log "building the Debian base ($suite: ${packages[*]}) with mmdebstrap into $base"
  rm -rf --one-file-system "$base"; mkdir -p "$base"
  started=$SECONDS
  include="$(IFS=,; echo "${packages[*]}")"
  if ! mmdebstrap --quiet --mode=root --variant=essential --include="$include" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --dpkgopt='path-exclude=/usr/share/info/*' \
      --customize-hook="APT_CONFIG=\"\$MMDEBSTRAP_APT_CONFIG\" bash '$here/bundle-kernel-headers.sh' \"\$1$bundled_headers\"" \
      "$suite" "$base/rootfs" "${sources[@]}" >"$base/mmdebstrap.log" 2>&1; then
    tail -n 20 "$base/mmdebstrap.log" >&2
    rm -rf --one-file-system "$base"
    die "mmdebstrap failed (log above)" "check that $mirror is reachable and the packages exist in $suite"
  fi
  # what is in the image, for the record (and the tests)
  chroot "$base/rootfs" dpkg-query -W -f='${Package} ${Version}\n' >"$base/packages.lock"
  touch "$base/.complete"
  log "base ready in $((SECONDS - started)) s ($(du -sh "$base/rootfs" | cut -f1)); kernel headers for BCC:" \
    "$(head -n 1 "$base/rootfs$bundled_headers/gpuwatch-headers.txt")"
fi
touch "$base"
prune base 2

# --- 2. gpuwatch wheel + dependencies ----------------------------------------------------------
work="$(mktemp -d)"
trap 'rm -rf --one-file-system "$work"' EXIT
mkdir -p "$work/src" "$work/wheels"
# a copy of the sources, so the build leaves nothing in the checkout: the working tree as it
# is, or a git revision (GPUWATCH_IMAGE_GIT_REF=v0.1.0, HEAD: what is committed, nothing else)
if [ -n "${GPUWATCH_IMAGE_GIT_REF:-}" ]; then
  log "building the gpuwatch wheel from git revision $GPUWATCH_IMAGE_GIT_REF of $repo"
  git -C "$repo" archive --format=tar "$GPUWATCH_IMAGE_GIT_REF" pyproject.toml README.md gpuwatch bpf \
    | tar -C "$work/src" -xf - || die "git archive $GPUWATCH_IMAGE_GIT_REF failed" "name a commit, tag or branch"
else
  log "building the gpuwatch wheel from the working tree $repo"
  cp -a "$repo/pyproject.toml" "$repo/README.md" "$work/src/"
  tar -C "$repo" --exclude=__pycache__ -cf - gpuwatch bpf | tar -C "$work/src" -xf -
fi
if ! SOURCE_DATE_EPOCH=315532800 "$python" -m pip wheel --quiet --no-deps --no-build-isolation \
    --wheel-dir "$work/wheels" "$work/src" >"$work/wheel.log" 2>&1; then
  cat "$work/wheel.log" >&2
  die "building the gpuwatch wheel failed" "check that setuptools is installed for $python"
fi
wheel="$(ls "$work"/wheels/gpuwatch-*.whl)"
pyver="$(chroot "$base/rootfs" python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
log "fetching its dependencies as wheels for Python $pyver (host pip configuration applies)"
if ! "$python" -m pip download --quiet --only-binary=:all: --implementation cp --python-version "$pyver" \
    --platform manylinux2014_x86_64 --dest "$work/wheels" "$wheel" >"$work/download.log" 2>&1; then
  cat "$work/download.log" >&2
  die "fetching gpuwatch's dependencies failed" "check the host's pip index configuration (pip config list)"
fi
# content hash of every wheel: names and bytes of their members (zip timestamps left out)
wheels_hash="$("$python" - "$work/wheels" <<'PY'
import hashlib, pathlib, sys, zipfile
digest = hashlib.sha256()
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    digest.update(path.name.encode())
    with zipfile.ZipFile(path) as archive:
        for name in sorted(archive.namelist()):
            digest.update(name.encode() + b"\0" + hashlib.sha256(archive.read(name)).digest())
print(digest.hexdigest())
PY
)"
bpf_hash="$(cd "$work/src" && find bpf -type f \( -name '*.c' -o -name '*.h' \) -print0 | sort -z | xargs -0 sha256sum | sha)"

# mount points the DaemonSet (and runc with a read-only rootfs) needs; usr/src, lib/modules and
# opt/gpuwatch/kernel-headers are for a deployment that mounts the host's kernel headers (they
# win over the bundled ones; the shipped DaemonSet and unit do not mount them)
mount_points=(host/proc run/containerd run/containers var/lib/docker/containers usr/src lib/modules
  etc/gpuwatch var/log/gpuwatch run/gpuwatch etc/kubernetes/node-feature-discovery/features.d
  opt/gpuwatch/kernel-headers sys/fs/bpf sys/fs/cgroup)
# what the app stage adds to the base: the image's second layer (the venv only of opt/gpuwatch:
# the bundled kernel headers next to it are the base's)
app_paths=(opt/gpuwatch/venv etc/gpuwatch-image "${mount_points[@]}")

# --- 3. app rootfs: base + venv ---------------------------------------------------------------
# (this script is in the key too: a change to the steps below rebuilds the app stage)
app_key="$(printf '%s\n' "base=$base_key" "wheels=$wheels_hash" "bpf=$bpf_hash" \
  "script=$(sha <"${BASH_SOURCE[0]}")" | sha)"
app="$cache/app-$app_key"
if [ ! -e "$app/.complete" ]; then
  log "installing gpuwatch $version into $venv (rootfs $app)"
  rm -rf --one-file-system "$app"; mkdir -p "$app"
  # hard links: the copy costs no space, and nothing below rewrites a base file in place
  # (new files only: the venv, compiled bytecode written via rename)
  cp -al "$base/rootfs" "$app/rootfs"
  mkdir -p "$app/rootfs/tmp/wheels"
  cp "$work"/wheels/*.whl "$app/rootfs/tmp/wheels/"
  # a private mount namespace: /proc for the chroot vanishes with it
  if ! unshare --mount --propagation private --fork /bin/sh -euc "
      mount -t proc proc '$app/rootfs/proc'
      chroot '$app/rootfs' python3 -m venv --system-site-packages $venv
      chroot '$app/rootfs' $venv/bin/python -m pip install --quiet --no-index --no-cache-dir \
        --disable-pip-version-check --find-links /tmp/wheels gpuwatch==$version
      chroot '$app/rootfs' $venv/bin/python -c 'import bcc, gpuwatch.cli.main'" >"$app/install.log" 2>&1; then
    cat "$app/install.log" >&2
    rm -rf --one-file-system "$app"
    die "installing the wheel into the image failed (log above)"
  fi
  rm -rf "$app/rootfs/tmp/wheels"
  # The wheel carries the probes' C sources (pyproject.toml data-files -> <venv>/share/gpuwatch/bpf);
  # check the installed package finds them, or the probes would fail only at run time.
  if ! chroot "$app/rootfs" $venv/bin/python -c \
      'from gpuwatch.probes.layout import HEADER_PATH; assert HEADER_PATH.is_file(), HEADER_PATH' \
      >>"$app/install.log" 2>&1; then
    cat "$app/install.log" >&2
    rm -rf --one-file-system "$app"
    die "the installed gpuwatch does not find its probe sources (bpf/) — is the wheel built from a full checkout?"
  fi
  for d in "${mount_points[@]}"; do mkdir -p "$app/rootfs/$d"; done
  printf '%s\n' "$image_ref" >"$app/rootfs/etc/gpuwatch-image"
  touch "$app/.complete"
  log "rootfs ready: $(du -sh "$app/rootfs/$venv" | cut -f1) venv on the base"
fi
touch "$app"
prune app 2

if [ "$mode" = rootfs ]; then
  echo "$app/rootfs"
  exit 0
fi

# --- 4. OCI image -----------------------------------------------------------------------------
need umoci umoci
need skopeo skopeo
log "writing the OCI image $image_ref to $out"
mkdir -p "$out"
layout="$out/oci"
rm -rf "$layout"
umoci init --layout "$layout"
umoci new --image "$layout:$version"
# layer 1: the Debian base; layer 2: what the app stage added (venv, bpf sources, mount points)
umoci insert --image "$layout:$version" --history.created_by "mmdebstrap $suite ${packages[*]}" \
  "$base/rootfs" /
mkdir -p "$work/app-layer"
# each path as it really lies in the rootfs: lib/modules is usr/lib/modules on a merged-/usr
# Debian, and a directory "lib" in this layer would replace the base layer's lib -> usr/lib
mapfile -t real_paths < <(for p in "${app_paths[@]}"; do chroot "$app/rootfs" realpath -m "/$p" | cut -c2-; done)
tar -C "$app/rootfs" -cf - "${real_paths[@]}" | tar -C "$work/app-layer" -xf -
umoci insert --image "$layout:$version" --history.created_by "gpuwatch $version wheel in $venv" \
  "$work/app-layer" /
umoci config --image "$layout:$version" --author gpuwatch \
  --config.entrypoint "$venv/bin/gpuwatch" --config.cmd agent \
  --config.env "PATH=$venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --config.env PYTHONUNBUFFERED=1 --config.workingdir / \
  --config.label "org.opencontainers.image.title=gpuwatch" \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "org.opencontainers.image.base.name=debian:$suite (mmdebstrap, no registry)"
umoci gc --layout "$layout"
archive="$out/gpuwatch-$version.docker.tar"
rm -f "$archive"
skopeo --insecure-policy copy --quiet "oci:$layout:$version" "docker-archive:$archive:$image_ref"
log "done: $archive ($(du -sh "$archive" | cut -f1)), OCI layout $layout (tag $version)"
log "load it: docker load -i $archive | podman load -i $archive | ctr -n k8s.io images import $archive"
echo "$archive"
