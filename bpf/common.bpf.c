/* common.bpf.c — maps and helpers shared by every gpuwatch kernel program (kernel side
 * only; layouts come from gpuwatch.h). Every map is bounded; a failed insert is counted in
 * gw_stats, never silent. */
#ifndef GW_VERBOSE_EVENTS
#define GW_VERBOSE_EVENTS 0
#endif
#ifndef GW_MAX_IOCTL_KEYS
#define GW_MAX_IOCTL_KEYS 16384
#endif

BPF_ARRAY(gw_config, struct gw_config, 1);
BPF_ARRAY(gw_stats, u64, GW_STAT_COUNT);
BPF_PERCPU_ARRAY(gw_pathbuf, struct gw_path, 1);
BPF_HASH(gw_tgids, u32, struct gw_tgid_state, GW_MAX_TGIDS);
BPF_HASH(gw_fds, struct gw_fd_key, struct gw_fd_val, GW_MAX_FDS);
BPF_HASH(gw_openinf, u32, struct gw_open_inflight, GW_MAX_INFLIGHT);
BPF_HASH(gw_ioctlinf, u32, struct gw_ioctl_inflight, GW_MAX_INFLIGHT);
BPF_F_TABLE("percpu_hash", struct gw_ioctl_key, struct gw_ioctl_val, gw_ioctls, GW_MAX_IOCTL_KEYS,
            BPF_F_NO_PREALLOC);
BPF_HASH(gw_mem, struct gw_mem_key, struct gw_mem_val, GW_MAX_CGROUPS);
BPF_HASH(gw_rm, struct gw_rm_key, struct gw_rm_val, GW_MAX_RM_ALLOCS);
BPF_HASH(gw_clients, struct gw_client_key, struct gw_client_val, GW_MAX_RM_CLIENTS);
BPF_HASH(gw_gpu_minor, u32, u32, GW_MAX_GPU_IDS);
BPF_HASH(gw_gpu_instance, u32, u32, GW_MAX_GPU_IDS);
BPF_F_TABLE("percpu_hash", struct gw_ioctl_key, struct gw_ioctl_val, gw_uvm_ioctls, GW_MAX_UVM_KEYS,
            BPF_F_NO_PREALLOC);
BPF_HASH(gw_cuda, struct gw_cuda_key, struct gw_cuda_val, GW_MAX_CUDA_ALLOCS);
BPF_HASH(gw_cudainf, u32, struct gw_cuda_inflight, GW_MAX_INFLIGHT);
BPF_HASH(gw_limits, u64, struct gw_limit, GW_MAX_CGROUPS);
BPF_RINGBUF_OUTPUT(gw_events, GW_RINGBUF_PAGES);

static __always_inline void gw_stat(u32 idx)
{
    u64 *v = gw_stats.lookup(&idx);
    if (v)
        __sync_fetch_and_add(v, 1);
}

static __always_inline void gw_emit(u32 type, u64 cgroup_id, u64 bytes, u64 value, u32 device,
                                    u32 source, u32 kind)
{
    /* reserved in the ring itself: no 80-byte copy on the (512-byte) BPF stack */
    struct gw_event *ev = gw_events.ringbuf_reserve(sizeof(struct gw_event));
    if (!ev) {
        gw_stat(GW_STAT_EVENTS_DROPPED);
        return;
    }
    u64 id = bpf_get_current_pid_tgid();

    ev->ts_ns = bpf_ktime_get_ns();
    ev->cgroup_id = cgroup_id;
    ev->bytes = bytes;
    ev->value = value;
    ev->type = type;
    ev->tgid = id >> 32;
    ev->tid = (u32)id;
    ev->device = device;
    ev->source = source;
    ev->kind = kind;
    bpf_get_current_comm(&ev->comm, sizeof(ev->comm));
    gw_events.ringbuf_submit(ev, 0);
}

/* The process's GPU state, created on its first device open or CUDA call. Every charge of
 * the process goes to the cgroup it was in then, so exit can subtract exactly. */
static __always_inline struct gw_tgid_state *gw_tgid_get_or_create(u32 tgid)
{
    struct gw_tgid_state *st = gw_tgids.lookup(&tgid);
    if (st)
        return st;
    struct gw_tgid_state fresh = {};
    fresh.cgroup_id = bpf_get_current_cgroup_id();
    fresh.gen = bpf_ktime_get_ns();
    if (gw_tgids.insert(&tgid, &fresh) == 0)
        gw_emit(GW_EV_NEW_GPU_PROCESS, fresh.cgroup_id, 0, 0, GW_DEV_UNKNOWN, 0, 0);
    st = gw_tgids.lookup(&tgid);
    if (!st)
        gw_stat(GW_STAT_TGID_OVERFLOW);
    return st;
}

#define GW_MEM_ALLOC 1
#define GW_MEM_FREE 2
#define GW_MEM_FAIL 3
#define GW_MEM_RELEASE 4   /* released by close/exit: live bytes only */

static __always_inline void gw_mem_account(u64 cgroup_id, u32 device, s64 delta, u32 what)
{
    struct gw_mem_key k = {};
    k.cgroup_id = cgroup_id;
    k.device = device;
    struct gw_mem_val *v = gw_mem.lookup(&k);
    if (!v) {
        struct gw_mem_val zero = {};
        gw_mem.insert(&k, &zero);
        v = gw_mem.lookup(&k);
        if (!v) {
            gw_stat(GW_STAT_CGROUP_OVERFLOW);
            return;
        }
    }
    if (delta != 0)
        __sync_fetch_and_add(&v->live_bytes, delta);
    if (what == GW_MEM_ALLOC)
        __sync_fetch_and_add(&v->allocs, 1);
    else if (what == GW_MEM_FREE)
        __sync_fetch_and_add(&v->frees, 1);
    else if (what == GW_MEM_FAIL)
        __sync_fetch_and_add(&v->failures, 1);
}

static __always_inline u32 gw_slot(u32 device)
{
    return device < GW_DEV_SLOTS ? device : GW_DEV_UNKNOWN;
}

