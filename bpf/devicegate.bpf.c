/* devicegate.bpf.c — device isolation: a BPF_PROG_TYPE_CGROUP_DEVICE program.
 *
 * Compiled and loaded on its own (bcc_loader unit "devicegate"), attached by
 * gpuwatch/probes/devicegate.py with a BPF link (always BPF_F_ALLOW_MULTI: it composes with
 * the runtime's own device program on pure-v2 hosts) to the v2 directory of every gated
 * container cgroup. The kernel runs it on every device access check (open for read/write,
 * mknod) of a process in that cgroup or below it.
 *
 * Verdict: a char device whose (major, minor) is a known GPU node (gw_gate_nodes, filled from
 * stat() of <prefix>N, never hard-coded) is allowed only if its GPU index is in the allow
 * mask of the deepest gated cgroup the caller is in (bpf_get_current_ancestor_cgroup_id over
 * the levels, so sub-cgroups a container creates stay gated). Everything else — control
 * nodes (nvidiactl, nvidia-uvm, modeset), other devices, block devices — is allowed (1);
 * the v1 devices controller or another program may still deny it. Deny = return 0 = EPERM.
 * Only helpers and the ctx are read; no kernel struct is dereferenced. */
#include <uapi/linux/bpf.h>
#include "gpuwatch.h"

BPF_HASH(gw_gate_nodes, struct gw_gate_node_key, struct gw_gate_node, GW_GATE_MAX_NODES);
BPF_HASH(gw_gate_allow, u64, struct gw_gate_allow, GW_GATE_MAX_CGROUPS);

int gw_device_gate(struct bpf_cgroup_dev_ctx *ctx)
{
    if ((ctx->access_type & 0xFFFF) != BPF_DEVCG_DEV_CHAR)
        return 1;
    struct gw_gate_node_key key = {};
    key.major = ctx->major;
    key.minor = ctx->minor;
    struct gw_gate_node *node = gw_gate_nodes.lookup(&key);
    if (!node)
        return 1;
    u32 index = node->index;
    if (index >= GW_GATE_MAX_GPUS)
        return 1;
    u64 mask = 0;
    int gated = 0;
    for (int level = 0; level < GW_GATE_MAX_DEPTH; level++) {
        u64 id = bpf_get_current_ancestor_cgroup_id(level);
        if (id == 0)
            break;  /* below the caller's own cgroup */
        struct gw_gate_allow *allow = gw_gate_allow.lookup(&id);
        if (allow) {  /* deepest gated ancestor wins */
            mask = allow->gpu_mask;
            gated = 1;
        }
    }
    if (!gated)
        return 1;
    return (mask >> index) & 1;
}
