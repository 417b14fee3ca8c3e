/* devices.bpf.c — which file descriptors are GPU device nodes.
 *
 * openat enter reads the path (bounded) and compares it with the configured prefix (config
 * map, bounded loop); exit records (tgid, fd) -> kind/minor for a successful open. close
 * releases the memory allocated through that fd (the driver frees a client's objects when
 * its fd is closed) and forgets the fd. Fds a process gets without an open (dup, fork) are
 * in inherit.bpf.c; fds opened before the probes started are seeded from user space
 * (gpuwatch/probes/fdseed.py) with the same value layout. */

#if GW_IOCTL
static __always_inline int gw_classify(const char *buf, u32 len, u32 *minor)
{
    char s[4] = {};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        u32 idx = len + j;
        if (idx < GW_PATH_MAX)
            s[j] = buf[idx];
    }
    *minor = GW_DEV_UNKNOWN;
    if (s[0] == 'c' && s[1] == 't' && s[2] == 'l' && s[3] == 0)
        return GW_KIND_CTL;
    if (s[0] == '-' && s[1] == 'u' && s[2] == 'v' && s[3] == 'm')
        return GW_KIND_UVM;
    if (s[0] >= '0' && s[0] <= '9') {
        u32 n = s[0] - '0';
        if (s[1] == 0) {
            *minor = n;
            return GW_KIND_GPU;
        }
        if (s[1] >= '0' && s[1] <= '9' && s[2] == 0) {
            *minor = n * 10 + (s[1] - '0');
            return GW_KIND_GPU;
        }
    }
    return GW_KIND_OTHER;
}

/* 1 + the highest device fd number of the process: bounds the copy at fork (inherit.bpf.c).
 * A benign race between threads: it only grows, and a low value only means the rescan from
 * user space seeds the child instead. */
static __always_inline void gw_note_fd(struct gw_tgid_state *st, u32 fd)
{
    if (fd + 1 > st->fd_hi)
        st->fd_hi = fd + 1;
}

int gw_enter_openat(struct gw_sys_enter_args *ctx)
{
    u32 zero = 0;
    struct gw_config *cfg = gw_config.lookup(&zero);
    if (!cfg)
        return 0;
    u32 len = cfg->prefix_len;
    if (len == 0)
        return 0;   /* no upper check here: clang would fold it into the loop bound below */
    struct gw_path *p = gw_pathbuf.lookup(&zero);
    if (!p)
        return 0;
    if (bpf_probe_read_user_str(p->buf, sizeof(p->buf), (void *)ctx->args[1]) <= 0)
        return 0;
    for (u32 i = 0; i < GW_PREFIX_MAX; i++) {
        if (i >= len)
            break;
        if (p->buf[i] != cfg->prefix[i])
            return 0;
    }
    if (len > GW_PREFIX_MAX)
        return 0;
    struct gw_open_inflight in = {};
    in.kind = gw_classify(p->buf, len, &in.minor);
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (gw_openinf.update(&tid, &in) != 0)
        gw_stat(GW_STAT_INFLIGHT_OVERFLOW);
    return 0;
}

int gw_exit_openat(struct gw_sys_exit_args *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    struct gw_open_inflight *inp = gw_openinf.lookup(&tid);
    if (!inp)
        return 0;
    struct gw_open_inflight in = *inp;
    gw_openinf.delete(&tid);
    if (ctx->ret < 0)
        return 0;
    struct gw_tgid_state *st = gw_tgid_get_or_create(tgid);
    if (!st)
        return 0;
    if (in.kind == GW_KIND_GPU && in.minor < GW_DEV_UNKNOWN)
        st->gpu_mask |= 1u << in.minor;   /* benign race between threads: bits only get set */
    struct gw_fd_key k = {};
    k.tgid = tgid;
    k.fd = (u32)ctx->ret;
    struct gw_fd_val v = {};
    v.kind = in.kind;
    v.minor = in.minor;
    v.tgid_gen = st->gen;
    v.fd_gen = bpf_ktime_get_ns();
    if (gw_fds.update(&k, &v) != 0)
        gw_stat(GW_STAT_FD_OVERFLOW);
    else
        gw_note_fd(st, k.fd);
#if GW_VERBOSE_EVENTS
    gw_emit(GW_EV_DEVICE_OPEN, st->cgroup_id, 0, k.fd, in.minor, 0, in.kind);
#endif
    return 0;
}

/* Forget a device fd (close, or the implicit close of dup2/dup3 onto it), releasing the bytes
 * allocated through it. */
static __always_inline void gw_forget_fd(u32 tgid, u32 fd)
{
    struct gw_fd_key k = {};
    k.tgid = tgid;
    k.fd = fd;
    struct gw_fd_val *v = gw_fds.lookup(&k);
    if (!v)
        return;
    struct gw_tgid_state *st = gw_tgids.lookup(&k.tgid);
    if (st && st->gen == v->tgid_gen) {
#pragma unroll
        for (int d = 0; d < GW_DEV_SLOTS; d++) {
            s64 b = v->rm_bytes[d];
            if (b != 0) {
                gw_mem_account(st->cgroup_id, d, -b, GW_MEM_RELEASE);
                __sync_fetch_and_add(&st->rm_bytes[d], -b);
            }
        }
    }
    gw_fds.delete(&k);
}

int gw_enter_close(struct gw_sys_enter_args *ctx)
{
    gw_forget_fd(bpf_get_current_pid_tgid() >> 32, (u32)ctx->args[0]);
    return 0;
}
#endif /* GW_IOCTL */
