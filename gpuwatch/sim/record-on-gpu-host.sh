#!/bin/sh
# Record real NVIDIA driver traffic on a GPU host, for `gpuwatch sim replay` in CI.
#
# Needs only a C compiler (cc/gcc, libc headers) and this repository: no CUDA toolkit,
# no Python, no BCC. Builds the LD_PRELOAD recorder (csrc/ioctl_recorder.c) and the
# CUDA driver-API exercise (csrc/cuda_exercise.c), runs the exercise under the recorder
# on the chosen GPU(s) -- or any command you give after `--` -- and leaves the traces
# (one <pid>.jsonl per process, format in TRACE_FORMAT.md) in one directory.
# See RECORDING.md.
#
#   gpuwatch/sim/record-on-gpu-host.sh                 # cuda_exercise on GPU 0
#   gpuwatch/sim/record-on-gpu-host.sh -d all          # ... on every GPU, one run each
#   gpuwatch/sim/record-on-gpu-host.sh -o /tmp/rec -- python3 train.py   # any program
set -eu

here=$(cd "$(dirname "$0")" && pwd)
csrc="$here/csrc"
out=""
devices="0"
usage() {
    echo "usage: $0 [-o OUTDIR] [-d DEVICE|all] [-- COMMAND [ARGS...]]" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in
    -o) [ $# -ge 2 ] || usage; out=$2; shift 2 ;;
    -d) [ $# -ge 2 ] || usage; devices=$2; shift 2 ;;
    -h | --help) usage ;;
    --) shift; break ;;
    *) usage ;;
    esac
done

cc=${CC:-}
if [ -z "$cc" ]; then
    for candidate in cc gcc clang; do
        if command -v "$candidate" >/dev/null 2>&1; then cc=$candidate; break; fi
    done
fi
[ -n "$cc" ] || { echo "no C compiler found: install gcc (apt-get install gcc libc6-dev)" >&2; exit 1; }

stamp=$(date -u +%Y%m%dT%H%M%SZ)
[ -n "$out" ] || out="$PWD/gwrec-$(uname -n)-$stamp"
mkdir -p "$out/build" "$out/traces"
out=$(cd "$out" && pwd)
flags="-O2 -g -Wall -Wextra -std=gnu11"
echo "building the recorder and cuda_exercise with $cc into $out/build"
# shellcheck disable=SC2086 # $flags is a list of words
"$cc" $flags -fPIC -shared -o "$out/build/libgwrec.so" "$csrc/ioctl_recorder.c" -ldl -lpthread
# shellcheck disable=SC2086
"$cc" $flags -o "$out/build/cuda_exercise" "$csrc/cuda_exercise.c" -ldl

# what this host is: kept next to the traces
{
    echo "recorded_at: $stamp"
    echo "kernel: $(uname -r) $(uname -m)"
    if [ -r /proc/driver/nvidia/version ]; then sed 's/^/driver: /' /proc/driver/nvidia/version; fi
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>&1 | sed 's/^/gpu: /'
        nvidia-smi --query-gpu=index,name,memory.total,persistence_mode,compute_mode,mig.mode.current \
            --format=csv 2>&1 | sed 's/^/smi: /'
    fi
    if [ -r /proc/self/ns/pid ] && [ -r /proc/1/ns/pid ] && [ "$(readlink /proc/self/ns/pid)" != "$(readlink /proc/1/ns/pid)" ]; then
        echo "warning: not in the host PID namespace: NVML lists host pids, checkpoints will show null"
    fi
} >"$out/host.txt" 2>&1

record() { # record NAME COMMAND...: traces in traces/NAME/, output in NAME.out
    name=$1
    shift
    echo "recording $name: $*"
    status=0
    env LD_PRELOAD="$out/build/libgwrec.so${LD_PRELOAD:+:$LD_PRELOAD}" GPUWATCH_REC_DIR="$out/traces/$name" \
        "$@" >"$out/$name.out" 2>&1 || status=$?
    echo "exit_status: $status" >>"$out/$name.out"
    echo "  exit status $status; output in $out/$name.out"
}

if [ $# -gt 0 ]; then
    record command "$@"
else
    if [ "$devices" = all ]; then
        count=$("$out/build/cuda_exercise" --count | sed -n 's/^devices //p')
        [ "${count:-0}" -gt 0 ] || { echo "CUDA sees no GPU (cuda_exercise --count)" >&2; exit 1; }
        devices=$(seq 0 $((count - 1)))
    fi
    for d in $devices; do
        record "exercise-gpu$d" "$out/build/cuda_exercise" --device "$d"
    done
fi

traces=$(find "$out/traces" -name '*.jsonl' | sort)
if [ -z "$traces" ]; then
    echo "no trace was written: did the program open /dev/nvidia*? (see the .out files)" >&2
    exit 1
fi
first=$(echo "$traces" | head -n 1)
driver=$(head -n 1 "$first" | sed -n 's/.*"driver_version": "\([^"]*\)".*/\1/p')
model=$(head -n 1 "$first" | sed -n 's/.*"gpus": \[{[^]]*"name": "\([^"]*\)".*/\1/p' |
    tr 'A-Z' 'a-z' | sed 's/[^a-z0-9]\{1,\}/-/g; s/^-//; s/-$//')
dest="tests/fixtures/traces/real/${driver:-unknown-driver}-${model:-unknown-gpu}"

echo
echo "traces ($(echo "$traces" | wc -l) files) are in $out/traces:"
for t in $traces; do
    printf '  %s: %s lines, %s ioctls, %s checkpoints\n' "${t#"$out/traces/"}" "$(wc -l <"$t")" \
        "$(grep -c '"ev": "ioctl"' "$t" || true)" "$(grep -c '"ev": "checkpoint"' "$t" || true)"
done
# RM_ALLOCs of a class the recorder's table (RM_ALLOC_PARAMS_BYTES) lacks, sent with paramsSize 0:
# their parameters were not captured
unsized=$(cat $traces | grep -c '"params_size_unknown": true' || true)
if [ "${unsized:-0}" -gt 0 ]; then
    echo "note: $unsized RM_ALLOC calls use a class the recorder does not know the parameter size of"
    echo "(\"params_size_unknown\": true, nothing captured): say which classes in the issue."
fi
echo
if head -n 1 "$first" | grep -q '"simulated": true'; then
    echo "note: these traces come from gpuwatch's SIMULATED node (GPUWATCH_SIM_STATE is set):"
    echo "they are not real-CUDA traces and do not belong under tests/fixtures/traces/real/."
fi
echo "to commit them, from the repository root:"
echo "  mkdir -p $dest"
echo "  cp -r $out/traces/* $out/*.out $out/host.txt $dest/"
echo "  git add $dest && git commit -m 'traces: real CUDA on ${model:-this GPU}, driver ${driver:-?}'"
echo "and say in the issue what they show (RECORDING.md, 'What to look for')."
