/* lifecycle.bpf.c — process exit and exec (sched:sched_process_exit, sched:sched_process_exec).
 *
 * When a thread-group leader with GPU state exits, subtract its per-device totals from its
 * cgroup (no iteration over allocation maps: the totals are kept per tgid) and drop its
 * state; its fd/allocation entries become stale (generation mismatch) and user space sweeps
 * them. exec() replaces the image: the driver state of a CUDA process dies with it (libcuda
 * opens the device nodes O_CLOEXEC), so exec releases like exit. Either emits one event
 * (rare: once per GPU process). Every exiting thread drops its in-flight records. */

static __always_inline void gw_release_tgid(u32 tgid, struct gw_tgid_state *st, u32 ev_type)
{
    u64 cg = st->cgroup_id;
#pragma unroll
    for (int d = 0; d < GW_DEV_SLOTS; d++) {
        s64 b = st->rm_bytes[d];
        if (b != 0)
            gw_mem_account(cg, d, -b, GW_MEM_RELEASE);
    }
    if (st->cuda_bytes != 0)
        gw_mem_account(cg, GW_DEV_CUDA, -st->cuda_bytes, GW_MEM_RELEASE);
    gw_tgids.delete(&tgid);
    gw_stat(GW_STAT_EXITS);
    /* always (not only verbose): one event per GPU process's end, so the agent's event pump
     * can admit a waiting container as soon as the memory is freed */
    gw_emit(ev_type, cg, 0, 0, GW_DEV_UNKNOWN, 0, 0);
}

int gw_sched_exit(void *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    struct gw_tgid_state *st = gw_tgids.lookup(&tgid);
    if (!st)
        return 0;
    gw_ioctlinf.delete(&tid);
    gw_openinf.delete(&tid);
    gw_cudainf.delete(&tid);
    if (tid != tgid)
        return 0;
    gw_release_tgid(tgid, st, GW_EV_PROCESS_EXIT);
    return 0;
}

int gw_sched_exec(void *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    struct gw_tgid_state *st = gw_tgids.lookup(&tgid);
    if (!st)
        return 0;
    gw_release_tgid(tgid, st, GW_EV_PROCESS_EXEC);
    return 0;
}
