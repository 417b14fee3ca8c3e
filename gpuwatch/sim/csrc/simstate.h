/*
 * gpuwatch simulated GPU node: the one definition of the shared state layout.
 *
 * One file per simulated node (default /dev/shm/gpuwatch-sim-default, env
 * GPUWATCH_SIM_STATE) is mmap'ed by the fake NVML (libnvidia-ml.so.1), the stub CUDA
 * driver (libcuda.so.1) and the Python side (through the gpuwatchsim_* helpers that
 * libnvidia-ml.so.1 also exports). Everything a simulated GPU "knows" lives here.
 *
 * Concurrency:
 *   - Structural changes (claiming/reaping process slots, charging/releasing memory,
 *     appending events) happen under flock(LOCK_EX) on the state file plus a
 *     process-local mutex (flock does not exclude threads sharing one descriptor).
 *     Readers that need a consistent view take flock(LOCK_SH).
 *   - Busy-time buckets are updated lock-free with 64-bit atomics (packed words).
 *
 * Liveness and host pids (the part a real driver gets for free):
 *   every process that owns a slot holds a classic POSIX record lock (fcntl F_SETLK)
 *   on byte SIM_LIVE_LOCK_BASE + slot of the state file. The kernel drops it when the
 *   process dies, so "lock free" == "process gone" -- memory is reclaimed exactly as a
 *   real GPU reclaims it on process exit, in every PID namespace. F_GETLK reports the
 *   lock owner's pid translated into the *caller's* PID namespace, so the fake NVML
 *   (running on the host) learns the host pid of a workload that runs in a container
 *   without scanning /proc. The slot also records the pid as seen inside the
 *   workload's own namespace, that namespace's inode and the process start time, for
 *   diagnostics (`gpuwatch sim status`).
 *   Caveat of classic record locks: closing ANY descriptor of the state file in a
 *   process drops that process's locks, so neither library ever closes its descriptor.
 */
#ifndef GPUWATCH_SIMSTATE_H
#define GPUWATCH_SIMSTATE_H

#include <stdint.h>

#define SIM_MAGIC 0x314d495357505447ULL /* "GTPWSIM1" little-endian */
#define SIM_LAYOUT_VERSION 2u /* 2: topology, row remapping, kmsg sequence */

#define SIM_MAX_DEVICES 8
#define SIM_MAX_PROCS 1024
#define SIM_MAX_EVENTS 256      /* ring of injected events (XID, ECC) */
#define SIM_BUCKETS 64          /* busy-time history per (process, device) */
#define SIM_BUCKET_NS 100000000ULL /* 100 ms per bucket -> 6.4 s of history */
#define SIM_NAME_LEN 96
#define SIM_PATH_LEN 256

/* byte offset of the per-slot liveness lock (beyond the data; locks need no data) */
#define SIM_LIVE_LOCK_BASE (1ULL << 40)

/* event types: values are NVML's nvmlEventType* bits */
#define SIM_EVENT_SINGLE_BIT_ECC 0x1ULL
#define SIM_EVENT_DOUBLE_BIT_ECC 0x2ULL
#define SIM_EVENT_XID 0x8ULL
#define SIM_EVENT_GPU_UNAVAILABLE 0x4000ULL

/* GPU interconnect of the simulated node (header.topology); see nvml.c "topology" */
#define SIM_TOPO_PCIE 0u         /* PCIe only: NVLink calls answer NOT_SUPPORTED */
#define SIM_TOPO_NVLINK_PAIRS 1u /* GPUs 2k and 2k+1 joined by SIM_PAIR_LINKS NVLinks */
#define SIM_TOPO_NVSWITCH 2u     /* every GPU: all links active, each to an NVSwitch */
#define SIM_NVLINK_MAX_LINKS 18  /* NVML_NVLINK_MAX_LINKS of the simulated driver (550) */
#define SIM_PAIR_LINKS 4
#define SIM_NVSWITCHES 4

/* RM_ALLOC parameter layout the stub issues (configurable per node) */
#define SIM_RMALLOC_NVOS64 0u
#define SIM_RMALLOC_NVOS21 1u

struct sim_device {
    char name[SIM_NAME_LEN];      /* "gpuwatch-sim H100 80GB HBM3" */
    char uuid[48];                /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    char serial[32];
    char pci_bus_id[32];          /* "00000000:1B:00.0" */
    uint64_t memory_total_bytes;
    uint32_t minor;               /* /dev/nvidia<minor> */
    uint32_t pci_bus;
    uint32_t lost;                /* 1 after `sim fault lost` */
    uint32_t power_limit_mw;
    uint32_t cc_major, cc_minor;  /* CUDA compute capability */
    uint32_t sm_clock_max_mhz, mem_clock_max_mhz;
    uint64_t ecc_corrected_volatile, ecc_uncorrected_volatile;
    uint64_t ecc_corrected_aggregate, ecc_uncorrected_aggregate;
    uint64_t energy_mj_base;      /* energy counter origin */
    /* row remapping (nvmlDeviceGetRemappedRows) */
    uint32_t remapped_rows_corr, remapped_rows_unc;
    uint32_t remap_pending;       /* a remap waits for the next GPU reset (`clear`) */
    uint32_t remap_failure;       /* 1 after `sim fault row-remap-failure` */
};

/* one busy bucket: high 32 bits = bucket epoch (low 32 bits of realtime_ns /
 * SIM_BUCKET_NS), low 32 bits = busy microseconds credited in that bucket. */
typedef uint64_t sim_bucket_t;

struct sim_proc {
    uint32_t in_use;              /* 0 free, 1 claimed */
    int32_t ns_pid;               /* getpid() inside the process's own PID namespace */
    uint64_t pidns_ino;           /* inode of /proc/self/ns/pid */
    uint64_t start_ticks;         /* /proc/self/stat field 22 */
    uint64_t generation;          /* bumps at every claim */
    uint32_t context_mask;        /* devices this process created a context on */
    uint32_t last_busy_epoch;     /* low 32 bits of the last bucket epoch it credited */
    uint64_t memory_bytes[SIM_MAX_DEVICES];
    uint64_t allocations[SIM_MAX_DEVICES];
    uint64_t busy_ns_total[SIM_MAX_DEVICES];  /* atomic */
    uint64_t launches[SIM_MAX_DEVICES];       /* atomic */
    sim_bucket_t buckets[SIM_MAX_DEVICES][SIM_BUCKETS]; /* atomic */
};

struct sim_event {
    uint64_t seq;                 /* 1-based, monotonically increasing */
    uint64_t type;                /* SIM_EVENT_* (NVML event type bit) */
    uint64_t data;                /* XID number / ECC count */
    uint64_t time_us;             /* CLOCK_REALTIME */
    uint32_t device;
    uint32_t pad;
};

struct sim_header {
    uint64_t magic;
    uint32_t layout_version;
    uint32_t device_count;
    uint64_t created_us;
    char node_name[64];
    char root[SIM_PATH_LEN];      /* sim root: <root>/dev/nvidia*, <root>/progress */
    char driver_version[32];      /* "550.54.15-gpuwatch-sim" */
    uint32_t cuda_driver_version; /* 12040 */
    uint32_t rm_alloc_params;     /* SIM_RMALLOC_* */
    uint32_t proc_high_water;     /* slots [0, high_water) may be in use */
    uint32_t rm_device_handles;   /* 1: contexts RM_ALLOC a client, device and subdevice */
    uint64_t event_seq;           /* last event seq written */
    uint32_t topology;            /* SIM_TOPO_* */
    uint32_t pad0;
    uint64_t kmsg_seq;            /* next sequence number of a <root>/kmsg record */
    struct sim_event events[SIM_MAX_EVENTS];
    struct sim_device devices[SIM_MAX_DEVICES];
    struct sim_proc procs[SIM_MAX_PROCS];
};

/* ---- shared helpers (simstate.c), hidden inside each library ---- */

struct sim_handle {
    int fd;
    struct sim_header *hdr;
};

/* open + map; returns 0 or -errno. Never closes the descriptor afterwards. */
int sim_open(const char *path, struct sim_handle *out);
/* Replace h by a fresh open of path, closing the old descriptor (unmapping the old
 * mapping when unmap_old). Used after fork (an inherited descriptor shares its flock
 * with the parent) and when the node was re-created. Only safe where the process holds
 * no liveness lock on the old file that it still needs. */
int sim_reopen(const char *path, struct sim_handle *h, int unmap_old);
/* 1 when h maps the file currently at path (same inode) */
int sim_is_current(const char *path, const struct sim_handle *h);
/* re-initialise process-local locks in a forked child */
void sim_after_fork_child(void);
/* path from GPUWATCH_SIM_STATE or the default */
const char *sim_state_path(void);
void sim_lock(struct sim_handle *h, int exclusive);
void sim_unlock(struct sim_handle *h);
uint64_t sim_realtime_ns(void);

/* identity of the calling process */
struct sim_self {
    int32_t ns_pid;
    uint64_t pidns_ino;
    uint64_t start_ticks;
};
void sim_self_identity(struct sim_self *out);

/* liveness: returns the owner's pid in the caller's PID namespace (> 0), 0 when the
 * owner is alive but invisible from here, -1 when the slot's owner is dead.
 * `self` is used to recognise the caller's own slot (F_GETLK cannot see own locks). */
int sim_slot_owner(struct sim_handle *h, int slot, const struct sim_self *self);

/* liveness of every slot in [0, count): pid in the caller's PID namespace (> 0), 0
 * alive but not visible from here, -1 dead/free. One read of /proc/locks (fallback:
 * F_GETLK per slot). Call with the state lock held for a consistent view. */
struct sim_live {
    uint32_t count;
    int32_t pid[SIM_MAX_PROCS];
};
void sim_liveness(struct sim_handle *h, const struct sim_self *self, struct sim_live *out);
/* memory of live slots on a device per `live`; reaps dead slots when `reap` (the caller
 * holds the exclusive lock) */
uint64_t sim_used_bytes_live(struct sim_handle *h, int dev, const struct sim_live *live, int reap);

/* busy microseconds of a slot on a device within [from_ns, to_ns] (realtime) */
uint64_t sim_slot_busy_us(const struct sim_proc *p, int dev, uint64_t from_ns, uint64_t to_ns);

/* sum of memory of live slots on a device; reaps dead slots when `reap` and the
 * caller holds the exclusive lock */
uint64_t sim_device_used_bytes(struct sim_handle *h, int dev, const struct sim_self *self, int reap);

#endif
