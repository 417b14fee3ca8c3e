/* gpuwatch.bpf.c — prelude of the one compilation unit BCC builds.
 *
 * BCC turns only functions of its main text into programs, so the loader builds that text by
 * concatenating, unchanged and in this order: this prelude, common.bpf.c, devices.bpf.c, ioctl.bpf.c,
 * cuda.bpf.c, lifecycle.bpf.c (gpuwatch/probes/bcc_loader.py: BPF_SOURCES). Maps are shared
 * by all programs. Groups are switched by cflags (-DGW_IOCTL=0/1, -DGW_ALLOC_UPROBES=0/1,
 * -DGW_LAUNCH_UPROBES=0/1, -DGW_VERBOSE_EVENTS=0/1); the device prefix reaches the kernel
 * through the gw_config array map. Never templated as text. */
#ifndef GW_IOCTL
#define GW_IOCTL 1
#endif
#ifndef GW_ALLOC_UPROBES
#define GW_ALLOC_UPROBES 1
#endif
#ifndef GW_LAUNCH_UPROBES
#define GW_LAUNCH_UPROBES 0
#endif

#include <uapi/linux/ptrace.h>
#include "gpuwatch.h"
