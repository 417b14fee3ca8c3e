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
 *
 * Execution engine (contention; see "engine" below and cuda.c run_kernel):
 *   kernels launched on one simulated GPU run one at a time, as on a time-sliced GPU
 *   (or up to `lanes` at once in the MPS-like mode). Each device has `lanes` engine
 *   words in the shared state; a launching thread runs its kernel only while it holds
 *   one. A holder *renews* its word (one CAS carrying the current CLOCK_MONOTONIC time)
 *   every few tens of microseconds while it spins, so the word itself says whether its
 *   holder is still running: a holder that stopped renewing for SIM_ENGINE_STALE_US
 *   (SIM_ENGINE_SLEEP_STALE_US where kernels sleep; cgroup-frozen, SIGSTOPped, dead, or
 *   starved of CPU that long) loses the engine to
 *   the next waiter, which takes it with a CAS from the exact stale word. A holder
 *   finds out at its next renewal (the CAS fails), discards the runnable time of that
 *   last step (it did not hold the engine; a sleeping kernel keeps the part of its step it
 *   asked for: the steal came at least the stale time after its last renewal, so that
 *   part ran on the engine, as a frozen process's launched kernel finishes on a real GPU)
 *   and queues again. Waiting is sleeping on a
 *   futex word of its own (`wait_wake`) -- neither CPU nor busy time. Waiters are served
 *   in ticket order (FIFO), woken by the hand-off described below; a waiter
 *   refreshes `wait_seen_ns` on every wake-up (at least every SIM_WAITER_POLL_NS; the
 *   first in line every SIM_FIRST_WAITER_POLL_NS, or at the moment the holder's word goes
 *   stale if that is sooner, to notice a stale holder at once; a hand-off also wakes the
 *   waiter after the one it names, which is first in line from then on) and one not
 *   seen for SIM_WAITER_STALE_NS (frozen while waiting) does not keep its place. A
 *   holder that has run for `timeslice_us` while others wait *hands* its lane to the
 *   first waiter in line -- one CAS writes the waiter's slot and the hand-off time into
 *   the word, then a futex wake -- and queues again; a kernel's end hands over the same
 *   way. The new holder's kernel time starts at the hand-off: its wake-up latency (it is
 *   runnable from the wake-up) counts as its kernel time, capped at the time since the
 *   hand-off. So the engine is never idle between tenants, co-tenants interleave at
 *   time-slice granularity with equal shares whatever the host's CPU load, and a waiter
 *   that was handed the lane but cannot run (frozen just then) loses it like a stale
 *   holder (a waiter named by a lane word is out of the line: it does not hold others
 *   back).
 *   Threads of one process take turns on a device (one context per process).
 */
#ifndef GPUWATCH_SIMSTATE_H
#define GPUWATCH_SIMSTATE_H

#include <stdint.h>

#define SIM_MAGIC 0x314d495357505447ULL /* "GTPWSIM1" little-endian */
#define SIM_LAYOUT_VERSION 5u /* 2: topology, row remapping, kmsg sequence; 3: execution engine;
                                 4: RM memory ledger (objects, managed, context), device instances;
                                 5: NVML sample ring, NVML cost model, NVML replay */

#define SIM_MAX_DEVICES 8
#define SIM_MAX_PROCS 1024
#define SIM_MAX_EVENTS 256      /* ring of injected events (XID, ECC) */
#define SIM_BUCKETS 64          /* busy-time history per (process, device) */
#define SIM_BUCKET_NS 100000000ULL /* 100 ms per bucket -> 6.4 s of history */
#define SIM_NAME_LEN 96
#define SIM_PATH_LEN 256

/* NVML process-utilisation samples (see "Sample ring" below and nvml.c "process samples").
 * The real driver keeps a ring of 72 samples per GPU (NV2080_CTRL_PERF_GPUMON_PERFMON_UTIL_SAMPLE,
 * open-gpu-kernel-modules src/nvidia/src/kernel/diagnostics/gpu_acct.c); NVML documents the
 * sample period as "between 1 second and 1/6 second depending on the product"
 * (nvmlDeviceGetProcessUtilization). The sim takes the short end, 1/6 s (12 s of history),
 * the period of an H100's samples; `sim up --sample-period-ms` picks another. */
#define SIM_SAMPLE_RING 72
#define SIM_DEFAULT_SAMPLE_PERIOD_NS 166666667ULL
#define SIM_MIN_SAMPLE_PERIOD_NS 10000000ULL   /* 10 ms .. */
#define SIM_MAX_SAMPLE_PERIOD_NS 1000000000ULL /* .. 1 s */
/* a period's samples are published this long after it ends: a launch that read the clock
 * just before the end may still be adding its last step to the period (a thread preempted
 * between reading the clock and crediting: ms on a loaded host) */
#define SIM_SAMPLE_PUBLISH_GUARD_NS 10000000ULL

/* NVML cost model (header.nvml_cost): what each fake NVML call burns in the calling thread */
#define SIM_NVML_COST_OFF 0u
#define SIM_NVML_COST_H100_580 1u /* H100, driver 580 (../shared/real-gpu/README.md section 3) */

/* What a running kernel does to its launching host thread (header.kernel_host; cuda.c
 * run_kernel). spin: the thread spins until it has been runnable the kernel's duration, so
 * each busy simulated GPU takes one host CPU (a 2-core machine runs two at full speed).
 * sleep: it sleeps in steps of at most SIM_KERNEL_SLEEP_STEP_NS, renewing the engine
 * between them, and a step counts as kernel time for as long as it slept (capped at the
 * step + SIM_KERNEL_SLEEP_SLACK_NS: a thread frozen or stopped in its sleep accrues no
 * more) plus its runnable time -- a node with enough host CPU per GPU, as real nodes have,
 * where the GPU's own work costs the host nothing. */
#define SIM_KERNEL_HOST_SPIN 0u
#define SIM_KERNEL_HOST_SLEEP 1u
#define SIM_KERNEL_SLEEP_STEP_NS 500000ULL
#define SIM_KERNEL_SLEEP_SLACK_NS 200000ULL

/* execution engine (see the comment at the top) */
#define SIM_MAX_LANES 8                    /* MPS-like mode: at most this many contexts at once */
#define SIM_ENGINE_STALE_US 20000ULL       /* a holder silent this long loses the engine */
/* ... on a node whose kernels sleep: a holder renews at least every SIM_KERNEL_SLEEP_STEP_NS
 * there, so silence is noticed ten times sooner. A real GPU does not idle for a frozen
 * process at all (its launched kernels finish, then the time slicer serves the others);
 * the 20 ms of the spinning host idled the engine that long at every freeze, ~16 % of the
 * GPU under a throttle that freezes tenants many times a second. */
#define SIM_ENGINE_SLEEP_STALE_US 2000ULL
#define SIM_WAITER_STALE_NS 50000000ULL    /* a waiter not seen this long does not keep its place */
#define SIM_WAITER_POLL_NS 20000000ULL     /* waiters wake at least this often ... */
#define SIM_FIRST_WAITER_POLL_NS 5000000ULL /* ... the first in line this often */
#define SIM_DEFAULT_TIMESLICE_US 2000u     /* run time after which a holder yields to waiters */
#define SIM_ENGINE_SLOT_BITS 12            /* engine word: (renewal time us << 12) | (slot + 1) */
#define SIM_ENGINE_SLOT_MASK 0xfffULL      /* slot + 1 */

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
    /* RM's view (see cuda.c "driver model"): the device instance NV0080's deviceId names
     * (numbered differently from minors: reversed order, so a probe that takes a
     * deviceId for a minor lands on the wrong GPU) and the gpu_id CARD_INFO and
     * NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 report (pci_bus << 8) */
    uint32_t device_instance;
    uint32_t gpu_id;
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
    /* NVML's per-process used memory, RM's rule: rm_memory_bytes (managed memory is not in
     * it: the H100 recording, tests/system/test_sim_real_shape.py) */
    uint64_t memory_bytes[SIM_MAX_DEVICES];
    uint64_t allocations[SIM_MAX_DEVICES];    /* cuMemAlloc* calls that succeeded */
    /* what memory_bytes is made of, and more (diagnostics; `gpuwatch sim status`, tests):
     * live class-0x40 memory objects at the sizes RM wrote back (context memory,
     * one object per cuMemAlloc or suballocation chunks), their count, the context's
     * share of them, mapped managed memory (nvidia-uvm, no RM object, not in NVML), and the
     * sizes the program asked cuMemAlloc* for (live allocations) */
    uint64_t rm_memory_bytes[SIM_MAX_DEVICES];
    uint64_t rm_objects[SIM_MAX_DEVICES];
    uint64_t context_bytes[SIM_MAX_DEVICES];
    uint64_t managed_bytes[SIM_MAX_DEVICES];
    uint64_t requested_bytes[SIM_MAX_DEVICES];
    uint64_t busy_ns_total[SIM_MAX_DEVICES];  /* atomic */
    uint64_t launches[SIM_MAX_DEVICES];       /* atomic */
    sim_bucket_t buckets[SIM_MAX_DEVICES][SIM_BUCKETS]; /* atomic */
    uint64_t engine_wait_ns_total[SIM_MAX_DEVICES]; /* atomic: launches waiting for the engine */
    /* Sample ring: busy microseconds per NVML sample period, the last SIM_SAMPLE_RING periods
     * (the driver's ring). Word = (low 32 bits of the period index realtime_ns / period_ns)
     * << 32 | busy us credited in that period, like the 100 ms buckets; credited with them
     * (cuda.c credit_busy, sim_credit_sample). The fake NVML turns each period this process
     * ran in into one sample of it (nvml.c "process samples"). atomic */
    sim_bucket_t samples[SIM_MAX_DEVICES][SIM_SAMPLE_RING];
};

/* One device's execution engine. A lane word is 0 (free) or
 * (renewal time in CLOCK_MONOTONIC microseconds << SIM_ENGINE_SLOT_BITS) | (slot + 1):
 * who holds it and when it last proved it is running (or was handed the lane), in one
 * CAS-able word. */
struct sim_engine {
    uint32_t lanes;               /* contexts that run at once: 1 time-sliced, N > 1 MPS-like */
    uint32_t timeslice_us;        /* a holder yields to waiters after this much run time */
    uint64_t next_ticket;         /* FIFO order of waiters */
    uint64_t acquisitions;        /* times a lane was taken */
    uint64_t steals;              /* ... of them from a holder that stopped renewing */
    uint64_t yields;              /* ... of them handed over at the end of a time slice */
    uint64_t lane[SIM_MAX_LANES]; /* engine words, see above */
    /* the waiting thread of each process slot (one per process and device), in dense
     * arrays so a scan touches little memory: its ticket (0: not waiting), when it last
     * showed it is alive (CLOCK_MONOTONIC ns), and its futex word (bumped to wake it) */
    uint64_t wait_ticket[SIM_MAX_PROCS];
    uint64_t wait_seen_ns[SIM_MAX_PROCS];
    uint32_t wait_wake[SIM_MAX_PROCS];
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
    uint32_t rm_device_handles;   /* unused since layout 4: contexts always allocate their objects */
    uint64_t event_seq;           /* last event seq written */
    uint32_t topology;            /* SIM_TOPO_* */
    uint32_t pad0;
    uint64_t kmsg_seq;            /* next sequence number of a <root>/kmsg record */
    uint64_t sample_period_ns;    /* NVML sample period (SIM_DEFAULT_SAMPLE_PERIOD_NS) */
    uint32_t nvml_cost;           /* SIM_NVML_COST_*: CPU each fake NVML call burns */
    uint32_t kernel_host;         /* SIM_KERNEL_HOST_*: what a kernel does to its host thread */
    /* NVML replay (nvml.c "replay"): a compiled recording the per-process calls answer from,
     * its first call shifted to replay_origin_us (CLOCK_REALTIME); empty path: no replay */
    uint64_t replay_origin_us;
    char replay_path[SIM_PATH_LEN];
    struct sim_engine engines[SIM_MAX_DEVICES];
    struct sim_event events[SIM_MAX_EVENTS];
    struct sim_device devices[SIM_MAX_DEVICES];
    struct sim_proc procs[SIM_MAX_PROCS];
};

_Static_assert(SIM_MAX_PROCS < SIM_ENGINE_SLOT_MASK, "engine word holds slot + 1");

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
uint64_t sim_monotonic_ns(void);

/* engine word helpers */
static inline uint64_t sim_engine_word(uint64_t now_us, int slot)
{
    return ((now_us & ((1ULL << (64 - SIM_ENGINE_SLOT_BITS)) - 1)) << SIM_ENGINE_SLOT_BITS) | (uint64_t)(slot + 1);
}
static inline int sim_engine_word_slot(uint64_t w) /* -1 for a free lane */
{
    return w ? (int)(w & SIM_ENGINE_SLOT_MASK) - 1 : -1;
}
static inline uint64_t sim_engine_word_us(uint64_t w)
{
    return w >> SIM_ENGINE_SLOT_BITS;
}
/* how long a holder may stay silent before it loses its lane: SIM_ENGINE_SLEEP_STALE_US on a
 * node whose kernels sleep, SIM_ENGINE_STALE_US otherwise */
static inline uint64_t sim_engine_stale_us(const struct sim_header *h)
{
    return __atomic_load_n(&h->kernel_host, __ATOMIC_RELAXED) == SIM_KERNEL_HOST_SLEEP ? SIM_ENGINE_SLEEP_STALE_US
                                                                                       : SIM_ENGINE_STALE_US;
}
/* 1 when a lane is free or its holder stopped renewing it for stale_us (frozen, stopped, dead) */
static inline int sim_engine_word_stale(uint64_t w, uint64_t now_us, uint64_t stale_us)
{
    if (!w)
        return 1;
    uint64_t t = sim_engine_word_us(w);
    return now_us > t && now_us - t > stale_us;
}

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

/* add busy microseconds to the sample period of now_ns in a slot's sample ring (lock-free) */
void sim_credit_sample(struct sim_proc *p, int dev, uint32_t busy_us, uint64_t now_ns, uint64_t period_ns);
/* busy microseconds a slot's sample ring holds for period `period_index` (0: none / aged out) */
uint32_t sim_sample_busy_us(const struct sim_proc *p, int dev, uint64_t period_index);
/* the node's sample period (the default when the header has none) */
static inline uint64_t sim_sample_period_ns(const struct sim_header *h)
{
    uint64_t p = h->sample_period_ns;
    return p >= SIM_MIN_SAMPLE_PERIOD_NS && p <= SIM_MAX_SAMPLE_PERIOD_NS ? p : SIM_DEFAULT_SAMPLE_PERIOD_NS;
}

/* busy microseconds of a slot on a device within [from_ns, to_ns] (realtime) */
uint64_t sim_slot_busy_us(const struct sim_proc *p, int dev, uint64_t from_ns, uint64_t to_ns);

/* sum of memory of live slots on a device; reaps dead slots when `reap` and the
 * caller holds the exclusive lock */
uint64_t sim_device_used_bytes(struct sim_handle *h, int dev, const struct sim_self *self, int reap);
/* Memory of every slot in use on `dev`, without checking who is alive: an upper bound of the
 * live sum, enough to admit an allocation without reading /proc/locks. */
uint64_t sim_used_bytes_in_use(struct sim_handle *h, int dev);

#endif
