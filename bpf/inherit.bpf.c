/* inherit.bpf.c — device fds a process gets without opening a device path.
 *
 * dup()/dup2()/dup3()/fcntl(F_DUPFD, F_DUPFD_CLOEXEC): enter notes the source fd when it is a
 * tracked device fd (and, for dup2/dup3, the target fd when it is one: the kernel closes it
 * implicitly); exit copies the entry to the returned fd. The copy keeps fd_gen, the identity
 * of the open file description, and starts with no bytes of its own.
 *
 * fork(): task:task_newtask (the parent is current, the child has not run yet) gives the
 * child's pid and the clone flags as tracepoint fields. New threads (CLONE_THREAD) share the
 * table and need nothing. For a new process, one gw_tgids lookup tells whether the parent
 * is a GPU process; only then its device fds 0 .. min(fd_hi, GW_FORK_FD_SCAN) are copied to
 * the child (one hash lookup per fd number below the parent's highest device fd), under a
 * fresh per-process state in the cgroup the child starts in (so the child's own allocations
 * are charged to it and released at its exit, like any process's). Fds above the scan bound are counted (fork_fds_unscanned) and the
 * child is seeded from /proc by user space at the next rescan (fdseed.py).
 *
 * No kernel struct is dereferenced: syscall arguments, return values and the task_newtask
 * fields (stable tracepoint layout, checked against its format file) only. */

#if GW_IOCTL
#define GW_F_DUPFD 0
#define GW_F_DUPFD_CLOEXEC 1030
#define GW_CLONE_THREAD 0x00010000ULL

struct gw_dup_inflight {   /* kernel only, key __u32 tid */
    u32 oldfd;
    u32 newfd;
    u32 close_new;         /* dup2/dup3 onto a tracked fd: the kernel closes it */
    u32 pad;
};

struct gw_newtask_args {   /* task:task_newtask */
    u64 common;
    s32 pid;               /* the new task */
    char comm[16];
    u32 pad;
    u64 clone_flags;
    s16 oom_score_adj;
};

BPF_HASH(gw_dupinf, u32, struct gw_dup_inflight, GW_MAX_INFLIGHT);

static __always_inline int gw_dup_enter(u32 oldfd, u32 newfd, int has_newfd)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gw_fd_key k = {};
    k.tgid = id >> 32;
    k.fd = oldfd;
    int tracked_old = gw_fds.lookup(&k) != 0;
    int tracked_new = 0;
    if (has_newfd && newfd != oldfd) {
        k.fd = newfd;
        tracked_new = gw_fds.lookup(&k) != 0;
    }
    if (!tracked_old && !tracked_new)
        return 0;
    struct gw_dup_inflight in = {};
    in.oldfd = oldfd;
    in.newfd = newfd;
    in.close_new = tracked_new;
    u32 tid = (u32)id;
    if (gw_dupinf.update(&tid, &in) != 0)
        gw_stat(GW_STAT_INFLIGHT_OVERFLOW);
    return 0;
}

int gw_enter_dup(struct gw_sys_enter_args *ctx)
{
    return gw_dup_enter((u32)ctx->args[0], 0, 0);
}

int gw_enter_dup2(struct gw_sys_enter_args *ctx)   /* also dup3 (same first two args) */
{
    return gw_dup_enter((u32)ctx->args[0], (u32)ctx->args[1], 1);
}

int gw_enter_fcntl(struct gw_sys_enter_args *ctx)
{
    u32 cmd = (u32)ctx->args[1];
    if (cmd != GW_F_DUPFD && cmd != GW_F_DUPFD_CLOEXEC)
        return 0;
    return gw_dup_enter((u32)ctx->args[0], 0, 0);
}

int gw_exit_dup(struct gw_sys_exit_args *ctx)      /* exit of dup, dup2, dup3 and fcntl */
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    struct gw_dup_inflight *inp = gw_dupinf.lookup(&tid);
    if (!inp)
        return 0;
    struct gw_dup_inflight in = *inp;
    gw_dupinf.delete(&tid);
    if (ctx->ret < 0)
        return 0;
    u32 newfd = (u32)ctx->ret;
    if (newfd == in.oldfd)
        return 0;             /* dup2(fd, fd): nothing changes */
    if (in.close_new)
        gw_forget_fd(tgid, in.newfd);
    struct gw_fd_key k = {};
    k.tgid = tgid;
    k.fd = in.oldfd;
    struct gw_fd_val *old = gw_fds.lookup(&k);
    if (!old)
        return 0;             /* not a device fd, or another thread closed it meanwhile */
    struct gw_tgid_state *st = gw_tgids.lookup(&tgid);
    if (!st || st->gen != old->tgid_gen)
        return 0;
    struct gw_fd_val v = {};
    v.kind = old->kind;
    v.minor = old->minor;
    v.tgid_gen = old->tgid_gen;
    v.fd_gen = old->fd_gen;   /* the same open file description */
    k.fd = newfd;
    if (gw_fds.update(&k, &v) != 0)
        gw_stat(GW_STAT_FD_OVERFLOW);
    else
        gw_note_fd(st, newfd);
    return 0;
}

int gw_task_newtask(struct gw_newtask_args *ctx)
{
    if (ctx->clone_flags & GW_CLONE_THREAD)
        return 0;
    u32 ptgid = bpf_get_current_pid_tgid() >> 32;
    struct gw_tgid_state *pst = gw_tgids.lookup(&ptgid);
    if (!pst)
        return 0;             /* the whole cost for a process that is not a GPU process */
    u32 hi = pst->fd_hi;
    if (hi == 0)
        return 0;             /* a GPU process known by its CUDA calls only: no device fd */
    u32 child = (u32)ctx->pid;
    u64 pgen = pst->gen;
    struct gw_tgid_state fresh = {};
    fresh.cgroup_id = bpf_get_current_cgroup_id();   /* the child starts in the parent's */
    fresh.gen = bpf_ktime_get_ns();
    fresh.gpu_mask = pst->gpu_mask;
    fresh.fd_hi = hi;
    if (hi > GW_FORK_FD_SCAN) {
        gw_stat(GW_STAT_FORK_FDS_UNSCANNED);
        hi = GW_FORK_FD_SCAN;
    }
    if (gw_tgids.update(&child, &fresh) != 0) {
        gw_stat(GW_STAT_TGID_OVERFLOW);
        return 0;
    }
    struct gw_fd_key pk = {};
    pk.tgid = ptgid;
    struct gw_fd_key ck = {};
    ck.tgid = child;
    struct gw_fd_val cv = {};
    cv.tgid_gen = fresh.gen;
#pragma clang loop unroll(disable)
    for (u32 fd = 0; fd < GW_FORK_FD_SCAN; fd++) {
        if (fd >= hi)
            break;
        pk.fd = fd;
        struct gw_fd_val *pv = gw_fds.lookup(&pk);
        if (!pv || pv->tgid_gen != pgen)
            continue;
        cv.kind = pv->kind;
        cv.minor = pv->minor;
        cv.fd_gen = pv->fd_gen;
        ck.fd = fd;
        if (gw_fds.update(&ck, &cv) != 0)
            gw_stat(GW_STAT_FD_OVERFLOW);
    }
    return 0;
}
#endif /* GW_IOCTL */
