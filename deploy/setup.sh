#!/usr/bin/env bash
# gpuwatch setup for a fresh Debian/Ubuntu machine, as root.
#
#   bash deploy/setup.sh run     # install everything, then monitor this node (`gpuwatch quickstart`:
#                                # the agent with its kernel probes; without GPUs a simulated node
#                                # whose trainer pod the demo policy throttles)
#   bash deploy/setup.sh test    # install everything, then lint, type-check and run the whole test suite
#   bash deploy/setup.sh install # install only
#
# What it installs (idempotent; safe to run again):
#   * Debian packages: BCC (python3-bpfcc: the real `bcc` module; never `pip install bcc`, that
#     PyPI name is an unrelated library), kernel headers, runc, strace, Prometheus + Alertmanager
#     (used by the system tests), a C compiler (the simulated GPU's libraries are built on demand),
#     mmdebstrap, umoci and skopeo (deploy/image/build.sh makes the agent image with them).
#   * kernel headers BCC can use when /lib/modules/$(uname -r)/build is missing (a merged Debian
#     header tree under /opt/gpuwatch/kernel-headers; gpuwatch finds it by itself).
#   * a virtualenv in .venv made from the system python3 with --system-site-packages (so it sees
#     Debian's bcc), with gpuwatch installed in editable mode plus its dev tools.
set -euo pipefail

mode="${1:-install}"
case "$mode" in run|test|install) ;; *)
  echo "usage: bash deploy/setup.sh run|test|install" >&2; exit 2 ;;
esac
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
log() { printf '\033[1m[gpuwatch setup]\033[0m %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  echo "setup needs root (apt-get, kernel headers, BPF). Re-run as: sudo bash deploy/setup.sh $mode" >&2
  exit 1
fi

apt_packages=(python3 python3-venv python3-dev python3-pip gcc libc6-dev make
  python3-bpfcc bpfcc-tools libbpfcc linux-headers-amd64
  runc strace prometheus prometheus-alertmanager iproute2 procps
  tmux  # tmux: drives the real `gpuwatch top` curses screen in system tests
  slurm-wlm  # slurmctld + slurmd + munge: tests/system/test_identity_slurm_real.py (one-node cluster, ~1 s)
  mmdebstrap umoci skopeo)  # the agent image without a registry: deploy/image/build.sh (+ tests/system/test_image.py)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # services are not started by us: tests run prometheus/alertmanager themselves on 127.0.0.1
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Kernel headers for BCC. Debian ships them split in -common and -<arch>; BCC wants one tree.
if [ ! -e "/lib/modules/$(uname -r)/build" ]; then
  hdr_ver="$(dpkg-query -W -f='${Package}\n' 'linux-headers-*-amd64' 2>/dev/null \
    | sed -n 's/^linux-headers-\(.*\)-amd64$/\1/p' | grep -v '^$' | sort -V | tail -n 1)"
  dest="/opt/gpuwatch/kernel-headers/$hdr_ver"
  if [ -n "$hdr_ver" ] && [ ! -e "$dest/.complete" ]; then
    kbuild="/usr/lib/linux-kbuild-$(echo "$hdr_ver" | cut -d. -f1,2)"
    log "merging Debian kernel headers $hdr_ver into $dest (for BCC)"
    rm -rf "$dest"; mkdir -p "$dest"
    cp -a "/usr/src/linux-headers-$hdr_ver-common/." "$dest/"
    cp -a "/usr/src/linux-headers-$hdr_ver-amd64/." "$dest/"
    rm -rf "$dest/scripts" "$dest/tools"
    ln -s "$kbuild/scripts" "$dest/scripts"
    ln -s "$kbuild/tools" "$dest/tools"
    touch "$dest/.complete"
  fi
  [ -n "$hdr_ver" ] && ln -sfn "$dest" /opt/gpuwatch/kernel-headers/current
fi

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import bcc' 2>/dev/null; then
  log "creating .venv (system python3 + --system-site-packages, so Debian's bcc is visible)"
  rm -rf .venv
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
log "pip install -e .[dev]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
.venv/bin/python -c 'import bcc' 2>/dev/null || log "warning: bcc not importable; probes will be off"

case "$mode" in
  install)
    log "done. Try: .venv/bin/gpuwatch doctor" ;;
  run)
    log "gpuwatch quickstart: the agent (kernel probes, enforcer with deploy/policies/demo.yaml on a"
    log "simulated node when there is no GPU) and its live view; q quits and cleans up"
    exec .venv/bin/gpuwatch quickstart ;;
  test)
    log "ruff"
    .venv/bin/ruff check gpuwatch tests benchmarks
    log "mypy"
    .venv/bin/mypy
    log "pytest (whole suite, including root/BPF/runc/Prometheus system tests)"
    set +e
    .venv/bin/python -m pytest -p no:cacheprovider "${@:2}"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
    exit "$rc" ;;
esac
