/* ioctl.bpf.c — NVIDIA driver ioctls on tracked fds, decoded along RM's object model.
 *
 * Enter: note the fd, the escape (_IOC_NR and _IOC_SIZE; IOCTL_XFER_CMD unwrapped only when its
 * outer size is 16, the inner cmd used whole) and the user address of the parameters, per
 * thread. Nothing else is read at entry: RM writes its answer (new handles, the rounded size,
 * the status) back, so every field is read at exit. nvidia-uvm fds carry bare ioctl numbers:
 * they are counted in their own table (gw_uvm_ioctls) and never decoded.
 *
 * Exit, RM escapes only:
 * - RM_ALLOC (NVOS21/NVOS64) with status 0 records an object of any class: a client
 *   (0x0/0x1/0x41: key hObjectNew, remembers the fd it was allocated on) in gw_clients, any
 *   other object in gw_rm with its parent, class, device slot and, for NV01_MEMORY_LOCAL_USER
 *   (0x40), NV_MEMORY_ALLOCATION_PARAMS.size as RM wrote it back. 0xC2 (no framebuffer memory,
 *   other params) and every other class record 0 bytes. The parameter block is sized by the
 *   class, as RM sizes it (gpuwatch.h GW_RM_ALLOC_PARAMS_TABLE), never by paramsSize: real
 *   libcuda sends paramsSize 0 on every RM_ALLOC.
 * - VID_HEAP_CONTROL (NVOS32) ALLOC_SIZE with LOCATION VIDMEM and not VIRTUAL records a
 *   0x40 object hMemory of data.AllocSize.size; FREE frees data.Free.hMemory like RM_FREE.
 * - RM_FREE of an object releases its bytes and those of all its descendants (each object's
 *   `bytes` includes its subtree; the ancestors up to the client are adjusted by a bounded
 *   walk); RM_FREE of the client (hObjectOld == hRoot) releases all the client's bytes.
 *   Descendants of a freed object stay in the map until user space sweeps them; they are
 *   recognised because their parent generation no longer matches, and never release twice.
 * - Closing the fd a client was allocated on releases its bytes (devices.bpf.c: the per-fd
 *   totals are charged to the client's fd), process exit releases all (lifecycle.bpf.c).
 * - Device slot of an object: NV01_DEVICE_0's deviceId is RM's device instance, mapped to a
 *   /dev/nvidiaN minor through the GET_ID_INFO(_V2) (instance -> gpu_id) and CARD_INFO
 *   (gpu_id -> minor) answers seen on any process (host-wide maps); children inherit their
 *   parent's slot. Where no mapping is known: the fd's GPU minor, else the process's only GPU.
 * - DUP_OBJECT makes a reference: recorded as an object of the source's class and GPU with 0
 *   bytes (objects allocated under a duplicated device land on its GPU); never charged, like
 *   IMPORT_OBJECT_FROM_FD and RM_ALLOC_MEMORY, which are only counted. */

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

struct gw_nvos54 {
    u32 h_client;
    u32 h_object;
    u32 cmd;
    u32 flags;
    u64 params;
    u32 params_size;
    u32 status;
};

struct gw_nvos32_head {    /* NVOS32 fields the decoder reads, up to data.AllocSize.attr */
    u32 h_root;
    u32 h_parent;
    u32 function;
    u32 h_vaspace;
    u32 pad16;
    u32 status;            /* @20 */
    u64 total;             /* @24 */
    u64 free;              /* @32 */
    u32 owner;             /* @40 data.AllocSize.owner / data.Free.owner */
    u32 h_memory;          /* @44 */
    u32 type_or_free_flags;/* @48 AllocSize.type / Free.flags */
    u32 flags;             /* @52 AllocSize.flags */
    u32 attr;              /* @56 AllocSize.attr */
};

struct gw_nvos55 {
    u32 h_client;
    u32 h_parent;
    u32 h_object;
    u32 h_client_src;
    u32 h_object_src;
    u32 flags;
    u32 status;
};

struct gw_card_info {      /* nv_ioctl_card_info_t, 72 bytes */
    u8 valid;
    u8 pad[15];
    u32 gpu_id;            /* @16 */
    u8 pad2[36];
    u32 minor;             /* @56 */
    u8 pad3[12];
};

/* where the bytes of an object chain are charged: the client's fd (or a root object's) */
struct gw_acct {
    u64 fd_gen;
    u32 fd;
    u32 ok;
};

static __always_inline int gw_is_client_class(u32 c)
{
    return c == GW_NV01_ROOT_CLIENT || c == GW_NV01_ROOT_NON_PRIV || c == GW_NV01_ROOT;
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
    in.cgroup_id = st->cgroup_id;
    in.kind = fv->kind;
    in.params = ctx->args[2];
    in.device = (fv->kind == GW_KIND_GPU) ? gw_slot(fv->minor) : GW_DEV_UNKNOWN;
    if (fv->kind == GW_KIND_UVM) {
        in.nr = cmd;   /* bare numbers: they would collide with RM escapes */
    } else {
        in.nr = cmd & 0xff;
        in.size = (cmd >> 16) & 0x3fff;
        in.rm = ((cmd >> 8) & 0xff) == GW_NV_IOCTL_MAGIC;
        if (in.rm && in.nr == GW_NV_ESC_IOCTL_XFER_CMD && in.size == GW_XFER_SIZE) {
            struct gw_nv_xfer x = {};
            if (bpf_probe_read_user(&x, sizeof(x), (void *)in.params) == 0) {
                in.nr = x.cmd;   /* the driver uses the inner cmd whole */
                in.size = x.size;
                in.params = x.ptr;
            } else {
                gw_stat(GW_STAT_READ_FAULTS);
                in.rm = 0;
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

static __always_inline void gw_count_uvm(u64 cgroup_id, u32 nr, s64 ret)
{
    struct gw_ioctl_key k = {};
    k.cgroup_id = cgroup_id;
    k.nr = nr;
    struct gw_ioctl_val *v = gw_uvm_ioctls.lookup(&k);
    if (!v) {
        struct gw_ioctl_val zero = {};
        gw_uvm_ioctls.insert(&k, &zero);
        v = gw_uvm_ioctls.lookup(&k);
        if (!v) {
            gw_stat(GW_STAT_UVM_OVERFLOW);
            return;
        }
    }
    v->calls += 1;
    if (ret < 0)
        v->failures += 1;
}

/* Slot of a device object or a root: the device instance's GPU, else the fd's GPU node,
 * else the process's only GPU node (a container given one GPU), else unknown. */
static __always_inline u32 gw_fallback_slot(struct gw_ioctl_inflight *in, struct gw_tgid_state *st)
{
    if (in->device != GW_DEV_UNKNOWN)
        return in->device;
    u32 m = st->gpu_mask;
    u32 d = GW_DEV_UNKNOWN;
#pragma unroll
    for (int b = 0; b < GW_DEV_UNKNOWN; b++)
        if (m == (1u << b))
            d = b;
    return d;
}

static __always_inline u32 gw_instance_slot(u32 instance)
{
    u32 *gpu_id = gw_gpu_instance.lookup(&instance);
    if (!gpu_id)
        return GW_DEV_UNKNOWN;
    u32 g = *gpu_id;
    u32 *minor = gw_gpu_minor.lookup(&g);
    return minor ? gw_slot(*minor) : GW_DEV_UNKNOWN;
}

/* Add `delta` bytes (slot `slot`) to the object (h, gen) and every ancestor up to its client;
 * fill where the chain is charged. acct->ok = 0 when a link is gone (a freed parent, a client
 * whose fd was closed: its bytes were released then) or the chain is too deep. */
static __always_inline void gw_chain_add(u32 tgid, u32 h_root, u32 h, u64 gen, s64 delta, u32 slot,
                                         struct gw_acct *acct)
{
    acct->ok = 0;
#pragma unroll
    for (int i = 0; i < GW_RM_DEPTH; i++) {
        if (h == h_root) {
            struct gw_client_key ck = {};
            ck.tgid = tgid;
            ck.h_client = h_root;
            struct gw_client_val *c = gw_clients.lookup(&ck);
            if (!c || c->gen != gen) {
                gw_stat(GW_STAT_RM_CHAIN_BROKEN);
                return;
            }
            u64 d = slot;
            asm volatile("" : "+r"(d));
            if (delta != 0 && d < GW_DEV_SLOTS)
                __sync_fetch_and_add(&c->bytes[d], delta);
            acct->fd = c->fd;
            acct->fd_gen = c->fd_gen;
            acct->ok = 1;
            return;
        }
        struct gw_rm_key k = {};
        k.tgid = tgid;
        k.h_root = h_root;
        k.h_object = h;
        struct gw_rm_val *v = gw_rm.lookup(&k);
        if (!v || v->gen != gen) {
            gw_stat(GW_STAT_RM_CHAIN_BROKEN);
            return;
        }
        if (delta != 0)
            __sync_fetch_and_add(&v->bytes, delta);
        if (v->parent_gen == 0) {
            acct->fd = v->fd;
            acct->fd_gen = v->fd_gen;
            acct->ok = 1;
            return;
        }
        h = v->h_parent;
        gen = v->parent_gen;
    }
    gw_stat(GW_STAT_RM_DEPTH_EXCEEDED);
}

/* Charge (delta > 0) or release (delta < 0) bytes on the accounting fd, the process and the
 * cgroup. Returns 0 when the accounting fd is gone (closed: already released). */
static __always_inline int gw_charge(struct gw_tgid_state *st, u32 tgid, struct gw_acct *acct, u32 slot,
                                     s64 delta, u32 what)
{
    struct gw_fd_key fk = {};
    fk.tgid = tgid;
    fk.fd = acct->fd;
    struct gw_fd_val *fv = gw_fds.lookup(&fk);
    if (!fv || fv->fd_gen != acct->fd_gen || fv->tgid_gen != st->gen)
        return 0;
    u64 d = gw_slot(slot);   /* 64-bit: the bound check below must hold for the index itself */
    gw_mem_account(st->cgroup_id, d, delta, what);
    asm volatile("" : "+r"(d));
    if (d < GW_DEV_SLOTS) {
        __sync_fetch_and_add(&st->rm_bytes[d], delta);
        __sync_fetch_and_add(&fv->rm_bytes[d], delta);
    }
    return 1;
}

static __always_inline void gw_new_client(struct gw_ioctl_inflight *in, struct gw_tgid_state *st, u32 tgid,
                                          u32 h_client)
{
    struct gw_fd_key fk = {};
    fk.tgid = tgid;
    fk.fd = in->fd;
    struct gw_fd_val *fv = gw_fds.lookup(&fk);
    if (!fv)
        return;
    struct gw_client_key ck = {};
    ck.tgid = tgid;
    ck.h_client = h_client;
    struct gw_client_val c = {};
    c.gen = bpf_ktime_get_ns();
    c.tgid_gen = st->gen;
    c.fd_gen = fv->fd_gen;
    c.fd = in->fd;
    if (gw_clients.update(&ck, &c) != 0)
        gw_stat(GW_STAT_RM_CLIENT_OVERFLOW);
}

/* Record a new object (status 0 already checked) and charge its bytes. `slot_hint`: the slot
 * of a device object (from its instance) or of a duplicate's source; GW_DEV_UNKNOWN: the
 * parent's slot (or the fallback for a device / an object without a known parent). */
static __always_inline void gw_new_object(struct gw_ioctl_inflight *in, struct gw_tgid_state *st, u32 tgid,
                                          u32 h_root, u32 h_parent, u32 h_new, u32 h_class, u64 bytes,
                                          u32 slot_hint)
{
    struct gw_rm_val v = {};
    v.bytes = bytes;
    v.gen = bpf_ktime_get_ns();
    v.tgid_gen = st->gen;
    v.h_parent = h_parent;
    v.h_class = h_class;
    u32 slot = GW_DEV_UNKNOWN;
    int rooted = 0, inherited = 0;
    if (h_parent == h_root) {
        struct gw_client_key ck = {};
        ck.tgid = tgid;
        ck.h_client = h_root;
        struct gw_client_val *c = gw_clients.lookup(&ck);
        if (c && c->tgid_gen == st->gen) {
            v.parent_gen = c->gen;
            rooted = 1;
        }
    } else {
        struct gw_rm_key pk = {};
        pk.tgid = tgid;
        pk.h_root = h_root;
        pk.h_object = h_parent;
        struct gw_rm_val *p = gw_rm.lookup(&pk);
        if (p && p->tgid_gen == st->gen) {
            v.parent_gen = p->gen;
            slot = p->device;   /* children live on their parent's GPU */
            rooted = 1;
            inherited = 1;
        }
    }
    if (h_class == GW_NV01_DEVICE_0 || slot_hint != GW_DEV_UNKNOWN) {
        slot = slot_hint;   /* a device's instance, or a duplicate's source GPU */
        inherited = 0;
    }
    if (slot == GW_DEV_UNKNOWN && !inherited)   /* an inherited slot stays its parent's */
        slot = gw_fallback_slot(in, st);
    v.device = slot;
    struct gw_acct acct = {};
    if (rooted) {
        gw_chain_add(tgid, h_root, h_parent, v.parent_gen, (s64)bytes, slot, &acct);
    } else {
        /* no known parent (a process seeded after its client was made, or traffic without
         * one): the object is a root charged to the fd of the call */
        struct gw_fd_key fk = {};
        fk.tgid = tgid;
        fk.fd = in->fd;
        struct gw_fd_val *fv = gw_fds.lookup(&fk);
        acct.fd = in->fd;
        acct.fd_gen = fv ? fv->fd_gen : 0;
        acct.ok = fv != 0;
    }
    v.fd = acct.fd;
    v.fd_gen = acct.fd_gen;
    struct gw_rm_key k = {};
    k.tgid = tgid;
    k.h_root = h_root;
    k.h_object = h_new;
    if (gw_rm.update(&k, &v) != 0)
        gw_stat(GW_STAT_RM_ALLOC_OVERFLOW);   /* bytes still charged; released at close/exit */
    if (bytes == 0 || !acct.ok)
        return;
    if (gw_charge(st, tgid, &acct, slot, (s64)bytes, GW_MEM_ALLOC)) {
#if GW_VERBOSE_EVENTS
        gw_emit(GW_EV_ALLOC, st->cgroup_id, bytes, h_new, gw_slot(slot), GW_SRC_RM, 0);
#endif
    }
}

/* RM_FREE / VID_HEAP FREE of (h_root, h_old) that RM answered with status 0. */
static __always_inline void gw_free_object(struct gw_tgid_state *st, u32 tgid, u32 h_root, u32 h_old)
{
    if (h_old == h_root) {   /* the client: everything under it */
        struct gw_client_key ck = {};
        ck.tgid = tgid;
        ck.h_client = h_root;
        struct gw_client_val *c = gw_clients.lookup(&ck);
        if (!c)
            return;
        struct gw_fd_key fk = {};
        fk.tgid = tgid;
        fk.fd = c->fd;
        struct gw_fd_val *fv = gw_fds.lookup(&fk);
        if (c->tgid_gen != st->gen || !fv || fv->fd_gen != c->fd_gen) {
            gw_stat(GW_STAT_RM_FREE_UNMATCHED);   /* its fd was closed: already released */
        } else {
#pragma unroll
            for (int d = 0; d < GW_DEV_SLOTS; d++) {
                s64 b = c->bytes[d];   /* the entry is read, then deleted (no 168-byte copy) */
                if (b != 0) {
                    gw_mem_account(st->cgroup_id, d, -b, GW_MEM_FREE);
                    __sync_fetch_and_add(&st->rm_bytes[d], -b);
                    __sync_fetch_and_add(&fv->rm_bytes[d], -b);
                }
            }
        }
        gw_clients.delete(&ck);
        return;
    }
    struct gw_rm_key k = {};
    k.tgid = tgid;
    k.h_root = h_root;
    k.h_object = h_old;
    struct gw_rm_val *vp = gw_rm.lookup(&k);
    if (!vp)
        return;   /* not an object we recorded (a duplicate, or made before we started) */
    struct gw_rm_val v = *vp;
    gw_rm.delete(&k);
    if (v.tgid_gen != st->gen || v.bytes <= 0)
        return;
    struct gw_acct acct = {};
    if (v.parent_gen == 0) {
        acct.fd = v.fd;
        acct.fd_gen = v.fd_gen;
        acct.ok = 1;
    } else {
        gw_chain_add(tgid, h_root, v.h_parent, v.parent_gen, -v.bytes, v.device, &acct);
    }
    if (!acct.ok || !gw_charge(st, tgid, &acct, v.device, -v.bytes, GW_MEM_FREE)) {
        gw_stat(GW_STAT_RM_FREE_UNMATCHED);   /* already released by close/exit/a parent's free */
        return;
    }
#if GW_VERBOSE_EVENTS
    gw_emit(GW_EV_FREE, st->cgroup_id, v.bytes, h_old, gw_slot(v.device), GW_SRC_RM, 0);
#endif
}

static __always_inline void gw_rm_alloc_exit(struct gw_ioctl_inflight *in, struct gw_tgid_state *st, u32 tgid)
{
    struct gw_nvos_head h = {};
    u32 status = 1;
    if (bpf_probe_read_user(&h, sizeof(h), (void *)in->params) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    /* status: NVOS21 @28, NVOS64 @40. paramsSize is not read: RM sizes the parameter block by
     * the class (gw_rm_alloc_params_bytes), and real libcuda sends 0 there. */
    u64 status_at = in->size == GW_NVOS21_SIZE ? 28 : 40;
    if (bpf_probe_read_user(&status, sizeof(status), (void *)(in->params + status_at)) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    u32 params_bytes = h.p_alloc_parms ? gw_rm_alloc_params_bytes(h.h_class) : 0;
    u64 bytes = 0;
    u32 slot_hint = GW_DEV_UNKNOWN;
    if (h.h_class == GW_NV01_MEMORY_LOCAL_USER && params_bytes >= GW_NV_MEMORY_PARAMS_SIZE_OFFSET + 8) {
        if (bpf_probe_read_user(&bytes, sizeof(bytes),
                                (void *)(h.p_alloc_parms + GW_NV_MEMORY_PARAMS_SIZE_OFFSET)) != 0) {
            gw_stat(GW_STAT_READ_FAULTS);
            bytes = 0;
        }
        if (status != 0) {
            u32 d = gw_fallback_slot(in, st);
            gw_mem_account(st->cgroup_id, d, 0, GW_MEM_FAIL);
            gw_emit(GW_EV_OOM, st->cgroup_id, bytes, status, d, GW_SRC_RM, 0);
            return;
        }
    }
    if (status != 0)
        return;
    if (gw_is_client_class(h.h_class)) {
        gw_new_client(in, st, tgid, h.h_new);
        return;
    }
    if (h.h_class == GW_NV01_DEVICE_0 && params_bytes >= 4) {
        u32 instance = 0;
        if (bpf_probe_read_user(&instance, sizeof(instance), (void *)h.p_alloc_parms) == 0)
            slot_hint = gw_instance_slot(instance);
    }
    gw_new_object(in, st, tgid, h.h_root, h.h_parent, h.h_new, h.h_class, bytes, slot_hint);
}

static __always_inline void gw_rm_free_exit(struct gw_ioctl_inflight *in, struct gw_tgid_state *st, u32 tgid)
{
    struct gw_nvos00 p = {};
    if (bpf_probe_read_user(&p, sizeof(p), (void *)in->params) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    if (p.status == 0)
        gw_free_object(st, tgid, p.h_root, p.h_old);
}

static __always_inline void gw_vid_heap_exit(struct gw_ioctl_inflight *in, struct gw_tgid_state *st, u32 tgid)
{
    struct gw_nvos32_head p = {};
    if (bpf_probe_read_user(&p, sizeof(p), (void *)in->params) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    if (p.function == GW_NVOS32_FUNCTION_FREE) {
        if (p.status == 0 && (p.type_or_free_flags & GW_NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED))
            gw_free_object(st, tgid, p.h_root, p.h_memory);
        return;
    }
    if (p.function != GW_NVOS32_FUNCTION_ALLOC_SIZE)
        return;
    if (((p.attr >> GW_NVOS32_ATTR_LOCATION_SHIFT) & 3) != 0 || (p.flags & GW_NVOS32_ALLOC_FLAGS_VIRTUAL))
        return;   /* not video memory, or only a virtual range */
    u64 bytes = 0;
    if (bpf_probe_read_user(&bytes, sizeof(bytes), (void *)(in->params + 88)) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    if (p.status != 0) {
        u32 d = gw_fallback_slot(in, st);
        gw_mem_account(st->cgroup_id, d, 0, GW_MEM_FAIL);
        gw_emit(GW_EV_OOM, st->cgroup_id, bytes, p.status, d, GW_SRC_RM, 0);
        return;
    }
    gw_new_object(in, st, tgid, p.h_root, p.h_parent, p.h_memory, GW_NV01_MEMORY_LOCAL_USER, bytes,
                  GW_DEV_UNKNOWN);
}

/* DUP_OBJECT: a 0-byte reference object of the source's class on the source's GPU */
static __always_inline void gw_dup_exit(struct gw_ioctl_inflight *in, struct gw_tgid_state *st, u32 tgid)
{
    struct gw_nvos55 p = {};
    if (bpf_probe_read_user(&p, sizeof(p), (void *)in->params) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    if (p.status != 0)
        return;
    struct gw_rm_key sk = {};
    sk.tgid = tgid;
    sk.h_root = p.h_client_src;
    sk.h_object = p.h_object_src;
    struct gw_rm_val *src = gw_rm.lookup(&sk);
    if (!src || src->tgid_gen != st->gen)
        return;   /* another process's object, or one made before we started */
    u32 h_class = src->h_class, slot = src->device;
    gw_new_object(in, st, tgid, p.h_client, p.h_parent, p.h_object, h_class, 0, slot);
}

/* NV0000 GET_ID_INFO(_V2): deviceInstance -> gpuId, host-wide */
static __always_inline void gw_control_exit(struct gw_ioctl_inflight *in)
{
    struct gw_nvos54 c = {};
    if (bpf_probe_read_user(&c, sizeof(c), (void *)in->params) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    if (c.status != 0 || c.params_size < 12 ||
        (c.cmd != GW_NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 && c.cmd != GW_NV0000_CTRL_CMD_GPU_GET_ID_INFO))
        return;
    u32 info[3] = {};   /* gpuId, gpuFlags, deviceInstance */
    if (bpf_probe_read_user(info, sizeof(info), (void *)c.params) != 0) {
        gw_stat(GW_STAT_READ_FAULTS);
        return;
    }
    u32 instance = info[2], gpu_id = info[0];
    if (gw_gpu_instance.update(&instance, &gpu_id) != 0)
        gw_stat(GW_STAT_GPU_MAP_OVERFLOW);
}

/* CARD_INFO: an array of nv_ioctl_card_info_t -> gpu_id -> minor, host-wide */
static __always_inline void gw_card_info_exit(struct gw_ioctl_inflight *in)
{
    u32 n = in->size / GW_CARD_INFO_SIZE;
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < GW_CARD_INFO_MAX; i++) {
        if (i >= n)
            break;
        struct gw_card_info ci = {};
        if (bpf_probe_read_user(&ci, sizeof(ci), (void *)(in->params + (u64)i * GW_CARD_INFO_SIZE)) != 0) {
            gw_stat(GW_STAT_READ_FAULTS);
            return;
        }
        if (!ci.valid)
            continue;
        u32 gpu_id = ci.gpu_id, minor = ci.minor;
        if (gw_gpu_minor.update(&gpu_id, &minor) != 0)
            gw_stat(GW_STAT_GPU_MAP_OVERFLOW);
    }
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
    if (in.kind == GW_KIND_UVM) {
        gw_count_uvm(in.cgroup_id, in.nr, ctx->ret);
        return 0;
    }
    gw_count_ioctl(in.cgroup_id, in.nr, ctx->ret);
    if (!in.rm)
        return 0;
    /* the status RM wrote back decides, not the syscall's return: a simulated node (no
     * driver) answers ENOTTY while the parameters hold the recorded answer */
    if (in.nr == GW_NV_ESC_RM_CONTROL && in.size == GW_NVOS54_SIZE) {
        gw_control_exit(&in);   /* the most frequent escape: no process state needed */
        return 0;
    }
    if (in.nr == GW_NV_ESC_CARD_INFO && in.size >= GW_CARD_INFO_SIZE) {
        gw_card_info_exit(&in);
        return 0;
    }
    struct gw_tgid_state *st = gw_tgids.lookup(&tgid);
    if (!st)
        return 0;
    if (in.nr == GW_NV_ESC_RM_ALLOC && (in.size == GW_NVOS21_SIZE || in.size == GW_NVOS64_SIZE))
        gw_rm_alloc_exit(&in, st, tgid);
    else if (in.nr == GW_NV_ESC_RM_FREE && in.size == GW_NVOS00_SIZE)
        gw_rm_free_exit(&in, st, tgid);
    else if (in.nr == GW_NV_ESC_RM_VID_HEAP_CONTROL && in.size == GW_NVOS32_SIZE)
        gw_vid_heap_exit(&in, st, tgid);
    else if (in.nr == GW_NV_ESC_RM_DUP_OBJECT && in.size == GW_NVOS55_SIZE)
        gw_dup_exit(&in, st, tgid);
    return 0;
}
#endif /* GW_IOCTL */
