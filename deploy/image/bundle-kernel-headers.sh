#!/usr/bin/env bash
# Put Debian's kernel headers into the agent image, for BCC, without installing them.
#
#   bash deploy/image/bundle-kernel-headers.sh DEST     # e.g. <rootfs>/opt/gpuwatch/bundled-kernel-headers
#
# Why: many GPU hosts have BTF but no kernel headers at all (COS, Bottlerocket, Talos, Flatcar,
# managed node images; the H100 host of issue 16), and BCC compiles the probes against a header
# tree. The probes use no kernel struct layout (tracepoint arguments, uprobe registers and
# helpers only), so the headers of any recent kernel serve on any kernel: this project compiles
# them with Debian's 6.1 headers on a 6.18 kernel. gpuwatch uses this tree only when the host
# provides none (gpuwatch/probes/bcc_loader.py, find_kernel_headers).
#
# What: the version linux-headers-amd64 names in the configured suite; its two packages
# (-common and -amd64) are downloaded and unpacked with dpkg-deb, NOT installed: installing
# them would pull linux-kbuild and linux-compiler-gcc-*-x86 (gcc) into an image that has no
# compiler. Of the merged tree only what clang's include paths read is kept: include/ and
# arch/x86/include/ (with the -amd64 flavour's generated headers: autoconf.h, asm-offsets.h...).
# Left out: scripts/ and tools/ (kbuild: BCC compiles in memory with the clang libraries and
# runs nothing from them), include/config/ (kbuild's per-option dependency stubs), the other
# architectures, Makefile, .config, Module.symvers. About 41 MB on disk, 10 MB compressed.
#
# Runs wherever apt can see the suite: as an mmdebstrap hook (build.sh: APT_CONFIG set to the
# image's apt configuration) or in the Containerfile's base stage (the image's own apt).
# Needs apt-get, apt-cache and dpkg-deb.
set -euo pipefail

dest="${1:?usage: bundle-kernel-headers.sh DEST}"
die() { printf '[gpuwatch image] error: %s\n' "$1" >&2; [ -n "${2:-}" ] && printf '  fix: %s\n' "$2" >&2; exit 1; }

# linux-headers-amd64 (meta) -> linux-headers-<abi>-amd64 -> linux-headers-<abi>-common
flavour="$(apt-cache depends linux-headers-amd64 2>/dev/null \
  | sed -n 's/^ *Depends: \(linux-headers-.*-amd64\)$/\1/p' | head -n 1)"
[ -n "$flavour" ] || die "apt-cache does not resolve linux-headers-amd64 to a versioned package" \
  "check that the suite's main component is in the apt sources (apt-get update ran)"
abi="${flavour#linux-headers-}"; abi="${abi%-amd64}"
common="linux-headers-$abi-common"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# apt-get download writes to the current directory; as root it warns that the _apt sandbox
# cannot write there, which is harmless
(cd "$work" && apt-get download -q "$common" "$flavour" >"$work/download.log" 2>&1) \
  || { cat "$work/download.log" >&2; die "apt-get download $common $flavour failed" "check the mirror"; }
for deb in "$work"/*.deb; do dpkg-deb --extract "$deb" "$work/x"; done
src_common="$work/x/usr/src/$common"
src_flavour="$work/x/usr/src/$flavour"
[ -d "$src_common/include" ] && [ -d "$src_flavour/arch/x86/include/generated" ] \
  || die "unexpected layout in $common/$flavour (no include/ or arch/x86/include/generated/)"

rm -rf "$dest"
mkdir -p "$dest/arch/x86/include"
# -common first, then the flavour over it (as deploy/setup.sh merges them on a host)
cp -a "$src_common/include" "$dest/"
cp -a "$src_flavour/include/." "$dest/include/"
cp -a "$src_common/arch/x86/include/." "$dest/arch/x86/include/"
cp -a "$src_flavour/arch/x86/include/." "$dest/arch/x86/include/"
rm -rf "$dest/include/config"
[ -f "$dest/include/generated/autoconf.h" ] || die "the merged tree has no include/generated/autoconf.h"

version="$(dpkg-deb --field "$(ls "$work"/"$flavour"_*.deb)" Version)"
# line 1: what `gpuwatch doctor` and the agent's log name; then how the tree was made
printf 'Debian %s %s\ninclude/ and arch/x86/include/ of %s and %s, merged by %s\n' \
  "$flavour" "$version" "$common" "$flavour" "deploy/image/bundle-kernel-headers.sh" >"$dest/gpuwatch-headers.txt"
printf '[gpuwatch image] bundled kernel headers: %s %s into %s (%s)\n' "$flavour" "$version" "$dest" \
  "$(du -sh "$dest" | cut -f1)" >&2
