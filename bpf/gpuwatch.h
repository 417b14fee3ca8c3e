/* gpuwatch.h — the single definition of every key, value, event and context layout shared
 * by the kernel programs (the .bpf.c files here) and user space (mirrored with ctypes in
 * gpuwatch/probes/layout.py; tests/unit/test_probes_layout.py compiles this header and checks
 * every size and offset against the mirror).
 *
 * Rules: fixed-width types only, explicit padding, no pointers (user addresses are __u64).
 * BPF code never dereferences kernel structs: it reads tracepoint arguments (the gw_sys_*
 * contexts below, whose layout is the stable syscall-tracepoint ABI), uprobe registers and
 * helpers only.
 */
#ifndef GPUWATCH_H
#define GPUWATCH_H

#include <linux/types.h>

/* ---- bounds (all maps are bounded; overflow is counted in gw_stats) -------------------- */
#ifndef GW_MAX_FDS
#define GW_MAX_FDS 8192          /* tracked (tgid, fd) device descriptors */
#endif
#ifndef GW_MAX_TGIDS
#define GW_MAX_TGIDS 4096        /* processes with GPU state */
#endif
#ifndef GW_MAX_CGROUPS
#define GW_MAX_CGROUPS 4096      /* cgroups with counters */
#endif
#ifndef GW_MAX_RM_ALLOCS
#define GW_MAX_RM_ALLOCS 65536   /* live (tgid, hRoot, hObject) RM objects, any class */
#endif
#ifndef GW_MAX_RM_CLIENTS
#define GW_MAX_RM_CLIENTS 16384  /* live (tgid, hClient) RM clients */
#endif
#ifndef GW_MAX_GPU_IDS
#define GW_MAX_GPU_IDS 64        /* host-wide gpu_id -> minor and device instance -> gpu_id */
#endif
#ifndef GW_MAX_UVM_KEYS
#define GW_MAX_UVM_KEYS 4096     /* (cgroup, nvidia-uvm ioctl number) counters */
#endif
#ifndef GW_RM_DEPTH
#define GW_RM_DEPTH 6            /* object levels walked from an object up to its client */
#endif
#ifndef GW_MAX_CUDA_ALLOCS
#define GW_MAX_CUDA_ALLOCS 65536 /* live (tgid, ptr) CUDA allocations */
#endif
#ifndef GW_MAX_INFLIGHT
#define GW_MAX_INFLIGHT 4096     /* syscalls / uprobe calls between entry and return, per tid */
#endif
#ifndef GW_FORK_FD_SCAN
#define GW_FORK_FD_SCAN 256      /* device fd numbers copied to a GPU process's child at fork */
#endif
#ifndef GW_RINGBUF_PAGES
#define GW_RINGBUF_PAGES 16      /* rare events only */
#endif

#define GW_PREFIX_MAX 112        /* device path prefix, bytes (config map) */
#define GW_PATH_MAX 128          /* bytes of an opened path that are inspected */
#define GW_DEV_SLOTS 17          /* GPU minors 0..15, slot 16 = device unknown */
#define GW_DEV_UNKNOWN 16
#define GW_DEV_CUDA 0xFFFFu      /* gw_mem_key.device for CUDA-API (uprobe) accounting */

/* ---- device kinds (what an opened path under the prefix is) ---------------------------- */
#define GW_KIND_CTL 1            /* <prefix>ctl */
#define GW_KIND_GPU 2            /* <prefix>N */
#define GW_KIND_UVM 3            /* <prefix>-uvm, <prefix>-uvm-tools */
#define GW_KIND_OTHER 4          /* anything else under the prefix (modeset, caps...) */

/* ---- NVIDIA ioctl ABI (open-gpu-kernel-modules) ----------------------------------------- */
#define GW_NV_IOCTL_MAGIC 0x46   /* 'F' */
#define GW_NV_ESC_RM_ALLOC_MEMORY 0x27
#define GW_NV_ESC_RM_ALLOC_OBJECT 0x28
#define GW_NV_ESC_RM_FREE 0x29
#define GW_NV_ESC_RM_CONTROL 0x2A
#define GW_NV_ESC_RM_ALLOC 0x2B
#define GW_NV_ESC_RM_DUP_OBJECT 0x34
#define GW_NV_ESC_RM_VID_HEAP_CONTROL 0x4A
#define GW_NV_ESC_CARD_INFO 200
#define GW_NV_ESC_IOCTL_XFER_CMD 211
#define GW_NVOS21_SIZE 32        /* RM_ALLOC: hRoot@0 hObjectParent@4 hObjectNew@8 hClass@12 pAllocParms@16 paramsSize@24 status@28 */
#define GW_NVOS64_SIZE 48        /* RM_ALLOC: as NVOS21 to @16, paramsSize@32 status@40 */
#define GW_NVOS00_SIZE 16        /* RM_FREE: hRoot@0 hObjectParent@4 hObjectOld@8 status@12 */
#define GW_NVOS54_SIZE 32        /* RM_CONTROL: hClient@0 hObject@4 cmd@8 params@16 paramsSize@24 status@28 */
#define GW_NVOS32_SIZE 184       /* VID_HEAP_CONTROL: hRoot@0 hObjectParent@4 function@8 status@20, data@40 */
#define GW_NVOS55_SIZE 28        /* DUP_OBJECT: hClient@0 hParent@4 hObject@8 hClientSrc@12 hObjectSrc@16 flags@20 status@24 */
#define GW_XFER_SIZE 16          /* nv_ioctl_xfer_t: cmd@0 size@4 ptr@8 */
#define GW_CARD_INFO_SIZE 72     /* nv_ioctl_card_info_t: valid@0 (u8) gpu_id@16 minor_number@56 */
#define GW_CARD_INFO_MAX 32
#define GW_NV01_ROOT 0x0
#define GW_NV01_ROOT_NON_PRIV 0x1
#define GW_NV01_ROOT_CLIENT 0x41
#define GW_NV01_DEVICE_0 0x80
#define GW_NV20_SUBDEVICE_0 0x2080
#define GW_NV01_MEMORY_LOCAL_USER 0x40
#define GW_NV01_MEMORY_LOCAL_PHYSICAL 0xC2
#define GW_NV_MEMORY_PARAMS_SIZE_OFFSET 64   /* NV_MEMORY_ALLOCATION_PARAMS.size (u64) */

/* RM_ALLOC parameter blocks are sized by the class, never by paramsSize: the RM looks the class
 * up in its resource table (rmapiGetClassAllocParamSize, open-gpu-kernel-modules
 * src/nvidia/src/kernel/rmapi/resource_desc.c, called from alloc_free.c with the caller's
 * paramsSize discarded), and real libcuda (580, CUDA 13, measured on an H100) sends every
 * RM_ALLOC with paramsSize 0. The table: class -> bytes RM copies in (sizeof the class's
 * allocation struct, measured by compiling NVIDIA's 580.142 SDK headers); "optional" classes
 * are read only when pAllocParms is not NULL; 0 = the class takes no parameters. The decoder
 * reads two of these blocks (0x40 size@64, 0x80 deviceId@0); the recorder captures all of them
 * (gpuwatch/sim/csrc/ioctl_recorder.c keeps the same table; a unit test compares them).
 * A class missing here: the decoder reads nothing from its parameters. */
#define GW_RM_ALLOC_PARAMS_TABLE(X) \
    X(0x0000, 4)    /* NV01_ROOT: NvHandle (optional) */ \
    X(0x0001, 4)    /* NV01_ROOT_NON_PRIV: NvHandle (optional) */ \
    X(0x0041, 4)    /* NV01_ROOT_CLIENT: NvHandle (optional) */ \
    X(0x0080, 56)   /* NV01_DEVICE_0: NV0080_ALLOC_PARAMETERS (optional), deviceId@0 */ \
    X(0x2080, 4)    /* NV20_SUBDEVICE_0: NV2080_ALLOC_PARAMETERS (optional) */ \
    X(0x2081, 4)    /* NV2081_BINAPI (optional) */ \
    X(0x0040, 128)  /* NV01_MEMORY_LOCAL_USER: NV_MEMORY_ALLOCATION_PARAMS (120 on 535), size@64 */ \
    X(0x003E, 128)  /* NV01_MEMORY_SYSTEM: NV_MEMORY_ALLOCATION_PARAMS */ \
    X(0x50A0, 128)  /* NV50_MEMORY_VIRTUAL: NV_MEMORY_ALLOCATION_PARAMS */ \
    X(0x00C2, 24)   /* NV01_MEMORY_LOCAL_PHYSICAL: NV_PHYSICAL_MEMORY_ALLOCATION_PARAMS */ \
    X(0x0071, 40)   /* NV01_MEMORY_SYSTEM_OS_DESCRIPTOR: NV_OS_DESC_MEMORY_ALLOCATION_PARAMS */ \
    X(0x90F1, 56)   /* FERMI_VASPACE_A: NV_VASPACE_ALLOCATION_PARAMETERS */ \
    X(0x00F8, 48)   /* NV_MEMORY_FABRIC: NV00F8_ALLOCATION_PARAMETERS */ \
    X(0x00FD, 80)   /* NV_MEMORY_MULTICAST_FABRIC: NV00FD_ALLOCATION_PARAMETERS */ \
    X(0x00DE, 8)    /* RM_USER_SHARED_DATA: NV00DE_ALLOC_PARAMETERS */ \
    X(0x503C, 4)    /* NV50_THIRD_PARTY_P2P: NV503C_ALLOC_PARAMETERS (optional) */ \
    X(0xC8B5, 8)    /* HOPPER_DMA_COPY_A: NVB0B5_ALLOCATION_PARAMETERS (optional) */ \
    X(0x83DE, 12)   /* GT200_DEBUGGER: NV83DE_ALLOC_PARAMETERS */ \
    X(0xCB33, 4)    /* NV_CONFIDENTIAL_COMPUTE (optional) */ \
    X(0xC661, 2)    /* HOPPER_USERMODE_A: NV_HOPPER_USERMODE_A_PARAMS (optional) */ \
    X(0xCBC0, 16)   /* HOPPER_COMPUTE_A: NV_GR_ALLOCATION_PARAMETERS (optional) */ \
    X(0xC86F, 368)  /* HOPPER_CHANNEL_GPFIFO_A: NV_CHANNEL_ALLOC_PARAMS */ \
    X(0xA06C, 20)   /* KEPLER_CHANNEL_GROUP_A: NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS */ \
    X(0x9067, 12)   /* FERMI_CONTEXT_SHARE_A: NV_CTXSHARE_ALLOCATION_PARAMETERS */ \
    X(0x90E6, 0)    /* GF100_SUBDEVICE_MASTER: no parameters */ \
    X(0x0079, 24)   /* NV01_EVENT_OS_EVENT: NV0005_ALLOC_PARAMETERS */

#define GW_RM_ALLOC_PARAMS_CASE(cls, bytes) case cls: return bytes;
/* Bytes of the RM_ALLOC parameter block of class `h_class` (0: none, or a class not in the table). */
static inline __attribute__((always_inline)) __u32 gw_rm_alloc_params_bytes(__u32 h_class)
{
    switch (h_class) {
    GW_RM_ALLOC_PARAMS_TABLE(GW_RM_ALLOC_PARAMS_CASE)
    default:
        return 0;
    }
}
#define GW_NV0000_CTRL_CMD_GPU_GET_ID_INFO 0x202
#define GW_NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 0x205   /* params: gpuId@0 gpuFlags@4 deviceInstance@8 */
#define GW_NVOS32_FUNCTION_ALLOC_SIZE 2   /* data.AllocSize: hMemory@44 flags@52 attr@56 size@88 */
#define GW_NVOS32_FUNCTION_FREE 3         /* data.Free: owner@40 hMemory@44 flags@48 */
#define GW_NVOS32_ATTR_LOCATION_SHIFT 25  /* attr bits 26:25; VIDMEM = 0 */
#define GW_NVOS32_ALLOC_FLAGS_VIRTUAL 0x80000
#define GW_NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED 0x1

/* ---- CUDA ------------------------------------------------------------------------------ */
#define GW_CUDA_SUCCESS 0
#define GW_CUDA_ERROR_OUT_OF_MEMORY 2
#define GW_CUDA_FN_ALLOC 1           /* cuMemAlloc_v2, cuMemAllocManaged, cuMemAllocAsync */
#define GW_CUDA_FN_ALLOC_PITCH 2     /* cuMemAllocPitch_v2: bytes = *pPitch * Height */
#define GW_CUDA_FN_CREATE 3          /* cuMemCreate: key is the generic allocation handle */

/* ---- rare events (ring buffer) --------------------------------------------------------- */
#define GW_EV_NEW_GPU_PROCESS 1
#define GW_EV_OOM 2                  /* CUDA_ERROR_OUT_OF_MEMORY returned / RM alloc failed */
#define GW_EV_OVER_LIMIT 3           /* allocation that would exceed the cgroup's limit */
#define GW_EV_KILL 4                 /* bpf_send_signal(SIGKILL) sent for an over-limit alloc */
#define GW_EV_STOP 5                 /* bpf_send_signal(SIGSTOP) sent: the enforcer decides next */
/* verbose events: compiled in only with -DGW_VERBOSE_EVENTS=1 (gpuwatch trace) */
#define GW_EV_DEVICE_OPEN 10
#define GW_EV_ALLOC 11
#define GW_EV_FREE 12
#define GW_EV_PROCESS_EXIT 13
#define GW_EV_PROCESS_EXEC 14

#define GW_SRC_RM 1                  /* gw_event.source: decoded driver ioctl */
#define GW_SRC_CUDA 2                /* libcuda uprobe */

/* ---- limit actions (gw_limit.action) ---------------------------------------------------- */
#define GW_ACTION_EVENT 0
#define GW_ACTION_KILL 1
#define GW_ACTION_STOP 2

/* ---- stats map indices (gw_stats, array of __u64) --------------------------------------- */
#define GW_STAT_FD_OVERFLOW 0
#define GW_STAT_TGID_OVERFLOW 1
#define GW_STAT_CGROUP_OVERFLOW 2
#define GW_STAT_RM_ALLOC_OVERFLOW 3
#define GW_STAT_CUDA_ALLOC_OVERFLOW 4
#define GW_STAT_INFLIGHT_OVERFLOW 5
#define GW_STAT_RM_FREE_UNMATCHED 6
#define GW_STAT_CUDA_FREE_UNMATCHED 7
#define GW_STAT_EVENTS_DROPPED 8
#define GW_STAT_EXITS 9
#define GW_STAT_READ_FAULTS 10
#define GW_STAT_FORK_FDS_UNSCANNED 11  /* fork of a GPU process with device fds >= GW_FORK_FD_SCAN */
#define GW_STAT_RM_CLIENT_OVERFLOW 12  /* gw_clients full: the client's objects are charged to the fd of each call */
#define GW_STAT_RM_CHAIN_BROKEN 13     /* object under a freed/closed parent (its bytes were already released) */
#define GW_STAT_RM_DEPTH_EXCEEDED 14   /* parent chain deeper than GW_RM_DEPTH: bytes not charged */
#define GW_STAT_GPU_MAP_OVERFLOW 15    /* gw_gpu_minor / gw_gpu_instance full */
#define GW_STAT_UVM_OVERFLOW 16        /* gw_uvm_ioctls full */
#define GW_STAT_COUNT 17

/* ---- syscall tracepoint contexts (stable ABI: 8-byte common header, nr, args at 16+8i) -- */
struct gw_sys_enter_args {
    __u64 common;               /* common_type/flags/preempt_count/pid */
    __s32 syscall_nr;
    __u32 pad;
    __u64 args[6];
};

struct gw_sys_exit_args {
    __u64 common;
    __s32 syscall_nr;
    __u32 pad;
    __s64 ret;
};

/* ---- configuration (array map gw_config, one element; written before attaching) --------- */
struct gw_config {
    __u32 prefix_len;
    __u32 flags;
    char prefix[GW_PREFIX_MAX];
};

/* ---- per-CPU scratch for an opened path -------------------------------------------------- */
struct gw_path {
    char buf[GW_PATH_MAX];
};

/* ---- process state: key __u32 tgid ------------------------------------------------------ */
struct gw_tgid_state {
    __u64 cgroup_id;            /* every charge of this process goes to this cgroup */
    __u64 gen;                  /* unique generation: stale fd/alloc entries never match */
    __u32 gpu_mask;             /* GPU minors (< 16) whose <prefix>N node it opened */
    __u32 fd_hi;                /* 1 + highest device fd recorded (bounds the copy at fork) */
    __s64 rm_bytes[GW_DEV_SLOTS];   /* live decoded video memory per device slot */
    __s64 cuda_bytes;           /* live CUDA-API bytes (uprobes) */
};

/* ---- tracked device descriptors --------------------------------------------------------- */
struct gw_fd_key {
    __u32 tgid;
    __u32 fd;
};

struct gw_fd_val {
    __u32 kind;                 /* GW_KIND_* */
    __u32 minor;                /* N for <prefix>N, else GW_DEV_UNKNOWN */
    __u64 tgid_gen;             /* gw_tgid_state.gen at open */
    __u64 fd_gen;               /* unique per open */
    __s64 rm_bytes[GW_DEV_SLOTS];   /* live bytes allocated through this fd (close frees) */
};

/* in-flight openat, key __u32 tid */
struct gw_open_inflight {
    __u32 kind;
    __u32 minor;
};

/* in-flight ioctl on a tracked fd, key __u32 tid: what the exit needs to read the answer */
struct gw_ioctl_inflight {
    __u64 params;               /* user address of the (inner) parameter struct */
    __u64 cgroup_id;            /* the process's cgroup (exit counts without a gw_tgids lookup) */
    __u32 fd;
    __u32 nr;                   /* _IOC_NR, the whole inner cmd of IOCTL_XFER_CMD, or the bare UVM number */
    __u32 size;                 /* (inner) parameter size */
    __u32 device;               /* slot of the fd's GPU node (GW_DEV_UNKNOWN for ctl/uvm) */
    __u32 kind;                 /* GW_KIND_* of the fd */
    __u32 rm;                   /* 1: an RM escape ('F' magic, not nvidia-uvm): decoded at exit */
};

/* ---- per-cgroup counters ------------------------------------------------------------------ */
struct gw_ioctl_key {           /* gw_ioctls (RM escapes) and gw_uvm_ioctls (bare UVM numbers) */
    __u64 cgroup_id;
    __u32 nr;                   /* _IOC_NR, the inner cmd of IOCTL_XFER_CMD, or the UVM number */
    __u32 pad;
};

struct gw_ioctl_val {           /* per-CPU */
    __u64 calls;
    __u64 failures;             /* syscall returned < 0 */
};

struct gw_mem_key {
    __u64 cgroup_id;
    __u32 device;               /* device slot, or GW_DEV_CUDA */
    __u32 pad;
};

struct gw_mem_val {
    __s64 live_bytes;
    __u64 allocs;
    __u64 frees;
    __u64 failures;             /* RM alloc status != 0 / CUDA_ERROR_OUT_OF_MEMORY */
};

struct gw_launch_val {          /* per-CPU, key __u64 cgroup_id */
    __u64 kernel_launches;      /* cuLaunchKernel, cuLaunchKernelEx */
    __u64 graph_launches;       /* cuGraphLaunch */
};

/* per-cgroup limit (filled by the enforcer), key __u64 cgroup_id */
struct gw_limit {
    __u64 limit_bytes;          /* live bytes allowed: max(CUDA-API bytes, decoded driver bytes) */
    __u32 action;               /* GW_ACTION_* */
    __u32 pad;
};

/* ---- the RM object model: clients and their objects ------------------------------------------
 * gw_clients (tgid, hClient) -> the client's generation, the fd it was allocated on (closing
 * that fd frees it) and its live bytes per device slot. gw_rm (tgid, hRoot, hObject) -> one
 * object of any class with its parent. Every object's `bytes` is its own size (video memory)
 * plus the live bytes of its descendants, so freeing a parent releases its whole subtree with
 * no recursion; descendants of a freed parent are recognised by a parent generation that no
 * longer matches (see bpf/ioctl.bpf.c). */
struct gw_rm_key {
    __u32 tgid;
    __u32 h_root;
    __u32 h_object;
    __u32 pad;
};

struct gw_rm_val {
    __s64 bytes;                /* own video memory + live bytes of all descendants */
    __u64 gen;                  /* unique per object */
    __u64 parent_gen;           /* gen of the parent (client or object) at creation; 0: a root */
    __u64 tgid_gen;
    __u64 fd_gen;               /* the accounting fd: the client's (a root: the fd of the call) */
    __u32 fd;
    __u32 device;               /* device slot: the device ancestor's GPU (children inherit it) */
    __u32 h_parent;
    __u32 h_class;
};

struct gw_client_key {
    __u32 tgid;
    __u32 h_client;
};

struct gw_client_val {
    __u64 gen;
    __u64 tgid_gen;
    __u64 fd_gen;               /* the fd the client was allocated on */
    __u32 fd;
    __u32 pad;
    __s64 bytes[GW_DEV_SLOTS];  /* live bytes of the client's objects per device slot */
};

struct gw_cuda_key {
    __u32 tgid;
    __u32 pad;
    __u64 ptr;                  /* device pointer or cuMemCreate handle */
};

struct gw_cuda_val {
    __u64 bytes;
    __u64 tgid_gen;
};

/* in-flight CUDA allocation, key __u32 tid */
struct gw_cuda_inflight {
    __u64 out_ptr;              /* user address where the result pointer/handle is written */
    __u64 bytes;                /* requested bytes (or Height for pitch) */
    __u64 pitch_ptr;            /* user address of *pPitch (pitch alloc) */
    __u32 fn;                   /* GW_CUDA_FN_* */
    __u32 pad;
};

/* ---- rare event (ring buffer record) ------------------------------------------------------ */
struct gw_event {
    __u64 ts_ns;
    __u64 cgroup_id;
    __u64 bytes;
    __u64 value;                /* pointer/handle, limit, or return code */
    __u32 type;                 /* GW_EV_* */
    __u32 tgid;
    __u32 tid;
    __u32 device;
    __u32 source;               /* GW_SRC_* */
    __u32 kind;                 /* device kind for DEVICE_OPEN */
    char comm[16];
};

/* ---- device mapping (host-wide; device instances and gpu ids are host-wide in RM) ----------
 * gw_gpu_minor: __u32 gpu_id -> __u32 /dev/nvidiaN minor (CARD_INFO answers);
 * gw_gpu_instance: __u32 RM device instance -> __u32 gpu_id (NV0000 GET_ID_INFO(_V2) answers).
 * An NV01_DEVICE_0 object's deviceId is the instance: instance -> gpu_id -> minor. */

/* ---- device gate (devicegate.bpf.c: a cgroup device program, loaded on its own) ----------
 * gw_gate_nodes: (major, minor) of each GPU node gpuwatch resolved by stat() of <prefix>N ->
 * its GPU index. gw_gate_allow: gated cgroup id -> bitmask of the GPU indices it may open.
 * Numbers not in gw_gate_nodes (control nodes, everything else) are always allowed. */
#define GW_GATE_MAX_GPUS 64      /* GPU indices a gw_gate_allow mask can name */
#define GW_GATE_MAX_NODES 256    /* GPU nodes known to the gate */
#define GW_GATE_MAX_CGROUPS 4096 /* gated cgroups */
#define GW_GATE_MAX_DEPTH 32     /* cgroup levels searched for a gated ancestor */

struct gw_gate_node_key {
    __u32 major;
    __u32 minor;
};

struct gw_gate_node {
    __u32 index;                /* N of <prefix>N */
    __u32 pad;
};

struct gw_gate_allow {
    __u64 gpu_mask;             /* bit N set: <prefix>N may be opened */
};

#endif /* GPUWATCH_H */
