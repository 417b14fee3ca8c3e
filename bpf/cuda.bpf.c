/* cuda.bpf.c — libcuda uprobes.
 *
 * Allocation group (GW_ALLOC_UPROBES): the entry probe stores the out-pointer and size per
 * thread (and checks the cgroup's limit before the allocation proceeds: against the larger of
 * its CUDA-API live bytes and the driver bytes the ioctl decoder counts); the return probe
 * reads the result pointer, records (tgid, ptr) -> size and charges the cgroup; an
 * out-of-memory return is counted and sent as a rare event. Frees look the pointer up.
 * Launch group (GW_LAUNCH_UPROBES, opt-in): one per-CPU counter increment per launch,
 * nothing sent to user space. */

#if GW_ALLOC_UPROBES
/* The cgroup's video memory as the decoder counts it on every GPU (0 without the ioctl group):
 * it includes what libcuda allocates without a cuMemAlloc (a context's 518 MiB on an H100) and
 * the driver's rounding, so a limit holds what NVML will show, not only the API's bytes. */
static __always_inline s64 gw_rm_live_bytes(u64 cgroup_id)
{
    s64 total = 0;
#pragma unroll
    for (u32 d = 0; d < GW_DEV_SLOTS; d++) {
        struct gw_mem_key mk = {};
        mk.cgroup_id = cgroup_id;
        mk.device = d;
        struct gw_mem_val *mv = gw_mem.lookup(&mk);
        if (mv)
            total += mv->live_bytes;
    }
    return total;
}

static __always_inline int gw_cuda_enter(u32 fn, u64 out_ptr, u64 bytes, u64 pitch_ptr)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    struct gw_tgid_state *st = gw_tgid_get_or_create(tgid);
    if (!st)
        return 0;
    if (fn != GW_CUDA_FN_ALLOC_PITCH) {
        struct gw_limit *lim = gw_limits.lookup(&st->cgroup_id);
        if (lim) {
            struct gw_mem_key mk = {};
            mk.cgroup_id = st->cgroup_id;
            mk.device = GW_DEV_CUDA;
            struct gw_mem_val *mv = gw_mem.lookup(&mk);
            s64 live = mv ? mv->live_bytes : 0;
            s64 rm_live = gw_rm_live_bytes(st->cgroup_id);
            if (rm_live > live)   /* the driver's view: contexts and rounding, as NVML counts them */
                live = rm_live;
            if (live + (s64)bytes > (s64)lim->limit_bytes) {
                gw_emit(GW_EV_OVER_LIMIT, st->cgroup_id, bytes, lim->limit_bytes, GW_DEV_CUDA,
                        GW_SRC_CUDA, 0);
                if (lim->action == GW_ACTION_KILL && bpf_send_signal(9) == 0)
                    gw_emit(GW_EV_KILL, st->cgroup_id, bytes, lim->limit_bytes, GW_DEV_CUDA,
                            GW_SRC_CUDA, 0);
                else if (lim->action == GW_ACTION_STOP && bpf_send_signal(19) == 0)
                    gw_emit(GW_EV_STOP, st->cgroup_id, bytes, lim->limit_bytes, GW_DEV_CUDA,
                            GW_SRC_CUDA, 0);
            }
        }
    }
    struct gw_cuda_inflight in = {};
    in.out_ptr = out_ptr;
    in.bytes = bytes;
    in.pitch_ptr = pitch_ptr;
    in.fn = fn;
    if (gw_cudainf.update(&tid, &in) != 0)
        gw_stat(GW_STAT_INFLIGHT_OVERFLOW);
    return 0;
}

/* cuMemAlloc_v2 / cuMemAllocManaged / cuMemAllocAsync (CUdeviceptr *dptr, size_t bytes, ...) */
int gw_cu_alloc(struct pt_regs *ctx)
{
    return gw_cuda_enter(GW_CUDA_FN_ALLOC, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0);
}

/* cuMemAllocPitch_v2 (CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height, uint elem) */
int gw_cu_alloc_pitch(struct pt_regs *ctx)
{
    return gw_cuda_enter(GW_CUDA_FN_ALLOC_PITCH, PT_REGS_PARM1(ctx), PT_REGS_PARM4(ctx),
                         PT_REGS_PARM2(ctx));
}

/* cuMemCreate (CUmemGenericAllocationHandle *handle, size_t size, const prop *, flags) */
int gw_cu_create(struct pt_regs *ctx)
{
    return gw_cuda_enter(GW_CUDA_FN_CREATE, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0);
}

int gw_cu_alloc_ret(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    struct gw_cuda_inflight *inp = gw_cudainf.lookup(&tid);
    if (!inp)
        return 0;
    struct gw_cuda_inflight in = *inp;
    gw_cudainf.delete(&tid);
    struct gw_tgid_state *st = gw_tgids.lookup(&tgid);
    if (!st)
        return 0;
    int rc = (int)PT_REGS_RC(ctx);
    u64 bytes = in.bytes;
    if (in.fn == GW_CUDA_FN_ALLOC_PITCH) {
        u64 pitch = 0;
        if (rc == GW_CUDA_SUCCESS && bpf_probe_read_user(&pitch, sizeof(pitch), (void *)in.pitch_ptr) != 0)
            gw_stat(GW_STAT_READ_FAULTS);
        bytes = pitch * in.bytes;
    }
    if (rc == GW_CUDA_ERROR_OUT_OF_MEMORY) {
        gw_mem_account(st->cgroup_id, GW_DEV_CUDA, 0, GW_MEM_FAIL);
        gw_emit(GW_EV_OOM, st->cgroup_id, bytes, rc, GW_DEV_CUDA, GW_SRC_CUDA, 0);
        return 0;
    }
    if (rc != GW_CUDA_SUCCESS)
        return 0;
    u64 ptr = 0;
    if (bpf_probe_read_user(&ptr, sizeof(ptr), (void *)in.out_ptr) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return 0;
    }
    struct gw_cuda_key k = {};
    k.tgid = tgid;
    k.ptr = ptr;
    struct gw_cuda_val v = {};
    v.bytes = bytes;
    v.tgid_gen = st->gen;
    if (gw_cuda.update(&k, &v) != 0)
        gw_stat(GW_STAT_CUDA_ALLOC_OVERFLOW);
    gw_mem_account(st->cgroup_id, GW_DEV_CUDA, bytes, GW_MEM_ALLOC);
    __sync_fetch_and_add(&st->cuda_bytes, bytes);
#if GW_VERBOSE_EVENTS
    gw_emit(GW_EV_ALLOC, st->cgroup_id, bytes, ptr, GW_DEV_CUDA, GW_SRC_CUDA, 0);
#endif
    return 0;
}

/* cuMemFree_v2 (CUdeviceptr) / cuMemFreeAsync (CUdeviceptr, stream) / cuMemRelease (handle) */
int gw_cu_free(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u64 ptr = PT_REGS_PARM1(ctx);
    if (ptr == 0)
        return 0;
    struct gw_cuda_key k = {};
    k.tgid = tgid;
    k.ptr = ptr;
    struct gw_cuda_val *vp = gw_cuda.lookup(&k);
    if (!vp) {
        gw_stat(GW_STAT_CUDA_FREE_UNMATCHED);
        return 0;
    }
    struct gw_cuda_val v = *vp;
    gw_cuda.delete(&k);
    struct gw_tgid_state *st = gw_tgids.lookup(&tgid);
    if (!st || st->gen != v.tgid_gen) {
        gw_stat(GW_STAT_CUDA_FREE_UNMATCHED);
        return 0;
    }
    gw_mem_account(st->cgroup_id, GW_DEV_CUDA, -(s64)v.bytes, GW_MEM_FREE);
    __sync_fetch_and_add(&st->cuda_bytes, -(s64)v.bytes);
#if GW_VERBOSE_EVENTS
    gw_emit(GW_EV_FREE, st->cgroup_id, v.bytes, ptr, GW_DEV_CUDA, GW_SRC_CUDA, 0);
#endif
    return 0;
}
#endif /* GW_ALLOC_UPROBES */

#if GW_LAUNCH_UPROBES
BPF_PERCPU_HASH(gw_launches, u64, struct gw_launch_val, GW_MAX_CGROUPS);

static __always_inline struct gw_launch_val *gw_launch_slot(void)
{
    u64 cg = bpf_get_current_cgroup_id();
    struct gw_launch_val *v = gw_launches.lookup(&cg);
    if (v)
        return v;
    struct gw_launch_val zero = {};
    gw_launches.insert(&cg, &zero);
    v = gw_launches.lookup(&cg);
    if (!v)
        gw_stat(GW_STAT_CGROUP_OVERFLOW);
    return v;
}

/* cuLaunchKernel / cuLaunchKernelEx */
int gw_cu_launch(struct pt_regs *ctx)
{
    struct gw_launch_val *v = gw_launch_slot();
    if (v)
        v->kernel_launches += 1;
    return 0;
}

/* cuGraphLaunch */
int gw_cu_graph_launch(struct pt_regs *ctx)
{
    struct gw_launch_val *v = gw_launch_slot();
    if (v)
        v->graph_launches += 1;
    return 0;
}
#endif /* GW_LAUNCH_UPROBES */
