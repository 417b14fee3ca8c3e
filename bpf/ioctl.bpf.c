/* ioctl.bpf.c — NVIDIA driver ioctls on tracked fds.
 *
 * Enter: decode the escape (_IOC_NR, _IOC_SIZE; IOCTL_XFER_CMD unwrapped), and for RM_ALLOC of
 * a video-memory class read the requested size. Exit: count the call (and a failure when the
 * syscall returned < 0) per (cgroup, escape) in a per-CPU map; read the status the driver
 * wrote back and, on success, record (tgid, hRoot, hObject) -> size so RM_FREE, close and
 * exit release exactly what was allocated. */

#if GW_IOCTL
struct gw_nv_xfer {
    u32 cmd;
    u32 size;
    u64 ptr;
};

struct gw_nvos_head {      /* common head of NVOS21 / NVOS64 */
    u32 h_root;
    u32 h_parent;
    u32 h_new;
    u32 h_class;
    u64 p_alloc_parms;
};

struct gw_nvos00 {
    u32 h_root;
    u32 h_parent;
    u32 h_old;
    u32 status;
};

static __always_inline int gw_is_video_class(u32 c)
{
    return c == GW_NV01_MEMORY_LOCAL_USER || c == GW_NV01_MEMORY_LOCAL_PHYSICAL;
}

int gw_enter_ioctl(struct gw_sys_enter_args *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    struct gw_fd_key fk = {};
    fk.tgid = tgid;
    fk.fd = (u32)ctx->args[0];
    struct gw_fd_val *fv = gw_fds.lookup(&fk);
    if (!fv)
        return 0;
    struct gw_tgid_state *st = gw_tgids.lookup(&tgid);
    if (!st || st->gen != fv->tgid_gen)
        return 0;   /* a stale entry of an exited process whose pid was reused */
    u32 cmd = (u32)ctx->args[1];
    struct gw_ioctl_inflight in = {};
    in.fd = fk.fd;
    in.nr = cmd & 0xff;
    in.size = (cmd >> 16) & 0x3fff;
    in.params = ctx->args[2];
    in.device = (fv->kind == GW_KIND_GPU) ? gw_slot(fv->minor) : GW_DEV_UNKNOWN;
    if (((cmd >> 8) & 0xff) == GW_NV_IOCTL_MAGIC) {
        if (in.nr == GW_NV_ESC_IOCTL_XFER_CMD) {
            struct gw_nv_xfer x = {};
            if (bpf_probe_read_user(&x, sizeof(x), (void *)in.params) == 0) {
                in.nr = x.cmd & 0xff;
                in.size = x.size;
                in.params = x.ptr;
            } else {
                gw_stat(GW_STAT_READ_FAULTS);
            }
        }
        if (in.nr == GW_NV_ESC_RM_ALLOC && (in.size == GW_NVOS21_SIZE || in.size == GW_NVOS64_SIZE)) {
            struct gw_nvos_head h = {};
            if (bpf_probe_read_user(&h, sizeof(h), (void *)in.params) == 0) {
                in.h_class = h.h_class;
                if (gw_is_video_class(h.h_class)) {
                    u64 sz = 0;
                    if (bpf_probe_read_user(&sz, sizeof(sz),
                                            (void *)(h.p_alloc_parms + GW_NV_MEMORY_PARAMS_SIZE_OFFSET)) == 0)
                        in.alloc_bytes = sz;
                    else
                        gw_stat(GW_STAT_READ_FAULTS);
                    if (in.device == GW_DEV_UNKNOWN) {
                        struct gw_rm_key dk = {};
                        dk.tgid = tgid;
                        dk.h_root = h.h_root;
                        dk.h_object = h.h_parent;
                        struct gw_devh_val *dv = gw_devh.lookup(&dk);
                        if (dv)
                            in.device = gw_slot(dv->device);
                    }
                    if (in.device == GW_DEV_UNKNOWN) {
                        /* a process that opened exactly one GPU node (a container given one
                         * GPU) can only be allocating on that one */
                        u32 m = st->gpu_mask;
#pragma unroll
                        for (int b = 0; b < GW_DEV_UNKNOWN; b++)
                            if (m == (1u << b))
                                in.device = b;
                    }
                }
            } else {
                gw_stat(GW_STAT_READ_FAULTS);
            }
        }
    }
    if (gw_ioctlinf.update(&tid, &in) != 0)
        gw_stat(GW_STAT_INFLIGHT_OVERFLOW);
    return 0;
}

static __always_inline void gw_count_ioctl(u64 cgroup_id, u32 nr, s64 ret)
{
    struct gw_ioctl_key k = {};
    k.cgroup_id = cgroup_id;
    k.nr = nr;
    struct gw_ioctl_val *v = gw_ioctls.lookup(&k);
    if (!v) {
        struct gw_ioctl_val zero = {};
        gw_ioctls.insert(&k, &zero);
        v = gw_ioctls.lookup(&k);
        if (!v) {
            gw_stat(GW_STAT_CGROUP_OVERFLOW);
            return;
        }
    }
    v->calls += 1;          /* per-CPU value: no atomics needed */
    if (ret < 0)
        v->failures += 1;
}

static __always_inline void gw_rm_alloc_exit(struct gw_ioctl_inflight *in, struct gw_tgid_state *st, u32 tgid)
{
    struct gw_nvos_head h = {};
    u32 status = 1;
    u32 status_off = in->size == GW_NVOS21_SIZE ? 28 : 40;
    if (bpf_probe_read_user(&h, sizeof(h), (void *)in->params) != 0 ||
        bpf_probe_read_user(&status, sizeof(status), (void *)(in->params + status_off)) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    struct gw_rm_key k = {};
    k.tgid = tgid;
    k.h_root = h.h_root;
    k.h_object = h.h_new;
    if (h.h_class == GW_NV01_DEVICE_0 || h.h_class == 0x2080) {
        if (status != 0)
            return;
        struct gw_devh_val dv = {};
        dv.tgid_gen = st->gen;
        if (h.h_class == GW_NV01_DEVICE_0) {
            u32 dev = GW_DEV_UNKNOWN;
            bpf_probe_read_user(&dev, sizeof(dev), (void *)h.p_alloc_parms);
            dv.device = gw_slot(dev);
        } else {
            struct gw_rm_key pk = k;
            pk.h_object = h.h_parent;
            struct gw_devh_val *parent = gw_devh.lookup(&pk);
            if (!parent)
                return;
            dv.device = parent->device;
        }
        gw_devh.update(&k, &dv);
        return;
    }
    if (!gw_is_video_class(h.h_class))
        return;
    u32 d = gw_slot(in->device);
    if (status != 0) {
        gw_mem_account(st->cgroup_id, d, 0, GW_MEM_FAIL);
        gw_emit(GW_EV_OOM, st->cgroup_id, in->alloc_bytes, status, d, GW_SRC_RM, 0);
        return;
    }
    u64 bytes = in->alloc_bytes;
    struct gw_fd_key fk = {};
    fk.tgid = tgid;
    fk.fd = in->fd;
    struct gw_fd_val *fv = gw_fds.lookup(&fk);
    struct gw_rm_val v = {};
    v.bytes = bytes;
    v.tgid_gen = st->gen;
    v.fd_gen = fv ? fv->fd_gen : 0;
    v.fd = in->fd;
    v.device = d;
    if (gw_rm.update(&k, &v) != 0)
        gw_stat(GW_STAT_RM_ALLOC_OVERFLOW);
    gw_mem_account(st->cgroup_id, d, bytes, GW_MEM_ALLOC);
    if (d < GW_DEV_SLOTS) {
        __sync_fetch_and_add(&st->rm_bytes[d], bytes);
        if (fv)
            __sync_fetch_and_add(&fv->rm_bytes[d], bytes);
    }
#if GW_VERBOSE_EVENTS
    gw_emit(GW_EV_ALLOC, st->cgroup_id, bytes, h.h_new, d, GW_SRC_RM, 0);
#endif
}

static __always_inline void gw_rm_free_exit(struct gw_ioctl_inflight *in, struct gw_tgid_state *st, u32 tgid)
{
    struct gw_nvos00 p = {};
    if (bpf_probe_read_user(&p, sizeof(p), (void *)in->params) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    if (p.status != 0)
        return;
    struct gw_rm_key k = {};
    k.tgid = tgid;
    k.h_root = p.h_root;
    k.h_object = p.h_old;
    struct gw_rm_val *v = gw_rm.lookup(&k);
    if (!v)
        return;   /* not a video-memory object we recorded */
    struct gw_rm_val rv = *v;
    gw_rm.delete(&k);
    struct gw_fd_key fk = {};
    fk.tgid = tgid;
    fk.fd = rv.fd;
    struct gw_fd_val *fv = gw_fds.lookup(&fk);
    if (rv.tgid_gen != st->gen || !fv || fv->fd_gen != rv.fd_gen) {
        gw_stat(GW_STAT_RM_FREE_UNMATCHED);   /* already released by close/exit */
        return;
    }
    u32 d = gw_slot(rv.device);
    gw_mem_account(st->cgroup_id, d, -(s64)rv.bytes, GW_MEM_FREE);
    if (d < GW_DEV_SLOTS) {
        __sync_fetch_and_add(&st->rm_bytes[d], -(s64)rv.bytes);
        __sync_fetch_and_add(&fv->rm_bytes[d], -(s64)rv.bytes);
    }
#if GW_VERBOSE_EVENTS
    gw_emit(GW_EV_FREE, st->cgroup_id, rv.bytes, p.h_old, d, GW_SRC_RM, 0);
#endif
}

int gw_exit_ioctl(struct gw_sys_exit_args *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    struct gw_ioctl_inflight *inp = gw_ioctlinf.lookup(&tid);
    if (!inp)
        return 0;
    struct gw_ioctl_inflight in = *inp;
    gw_ioctlinf.delete(&tid);
    struct gw_tgid_state *st = gw_tgids.lookup(&tgid);
    if (!st)
        return 0;
    gw_count_ioctl(st->cgroup_id, in.nr, ctx->ret);
    if (in.nr == GW_NV_ESC_RM_ALLOC && (in.size == GW_NVOS21_SIZE || in.size == GW_NVOS64_SIZE))
        gw_rm_alloc_exit(&in, st, tgid);
    else if (in.nr == GW_NV_ESC_RM_FREE && in.size == GW_NVOS00_SIZE)
        gw_rm_free_exit(&in, st, tgid);
    return 0;
}
#endif /* GW_IOCTL */
