/*
 * gpuwatch-sim fake NVML: libnvidia-ml.so.1 for a simulated GPU node.
 *
 * Implements the NVML subset gpuwatch, nvidia-ml-py and nvitop use, with the real ABI
 * (struct layouts and return codes of nvml.h), over the node's shared state file
 * (GPUWATCH_SIM_STATE, see simstate.h). Functions that are not implemented are simply
 * not exported, so callers get the real "function not found" behaviour
 * (NVMLError_FunctionNotFound in nvidia-ml-py).
 *
 * Reported values:
 *   memory      used = sum of what live processes hold (the stub's ledger), reserved 0;
 *   processes   host pids (from the liveness locks, see simstate.h); dead ones never;
 *               usedGpuMemory follows RM's rule: the process's live class-0x40 memory
 *               objects at their rounded sizes (context memory, suballocation chunks,
 *               pool and VMM objects), never managed memory, as the H100 recording shows
 *               (cuda.c "driver model", README);
 *   utilisation busy time credited by kernel launches over the last second, summed
 *               over processes and clamped to 100; memory utilisation = gpu / 2;
 *   temperature 30 C + 0.4 C per utilisation point; power 70 W + 6.3 W per point;
 *   events      XID / ECC injected with `gpuwatch sim fault`.
 *
 * The library also exports a few gpuwatchsim_* helpers (not NVML) that the Python side
 * uses to create the state file and inject faults, so the layout has one definition.
 */
#define _GNU_SOURCE
#include "simstate.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

struct nvml_device {
    unsigned int index;
};
typedef struct nvml_device *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

typedef struct {
    unsigned long long bar1Total, bar1Free, bar1Used;
} nvmlBAR1Memory_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* _v2 and _v3 share this layout */

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    unsigned long long timeStamp;
    unsigned int pid, smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;

typedef struct {
    unsigned int version, processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_t;
#define nvmlProcessesUtilizationInfo_v1 ((unsigned int)(sizeof(nvmlProcessesUtilizationInfo_t) | (1u << 24)))

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t; /* _v3 */

typedef struct {
    char busId[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    unsigned int reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfo_v2_t; /* _v1 / _v2 */

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
} nvmlEventData_v1_t;

struct nvml_event_set {
    uint64_t last_seq;
    uint64_t types[SIM_MAX_DEVICES]; /* registered event mask per device */
};
typedef struct nvml_event_set *nvmlEventSet_t;

_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t is 40 bytes");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t is 24 bytes");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t is 68 bytes");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t is 32 bytes");
_Static_assert(sizeof(nvmlProcessUtilizationInfo_v1_t) == 40, "proc util info 40 bytes");

/* ---- library state ---- */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_init_count;
static int g_mapped; /* the state file stays mapped (and its fd open) once opened */
static struct sim_handle g_sim;
static struct sim_self g_self;
static struct nvml_device g_devices[SIM_MAX_DEVICES];
static pthread_mutex_t g_scratch_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_live g_live; /* guarded by g_scratch_lock */

#define UTIL_WINDOW_NS 1000000000ULL

static int dev_index(nvmlDevice_t d)
{
    if (!g_init_count || !d)
        return -1;
    if (d < &g_devices[0] || d >= &g_devices[SIM_MAX_DEVICES])
        return -1;
    int i = (int)(d - &g_devices[0]);
    if ((unsigned)i >= g_sim.hdr->device_count)
        return -1;
    return i;
}

/* validates the handle; returns the index or a negative NVML error */
static int check_dev(nvmlDevice_t d)
{
    if (!g_init_count)
        return -NVML_ERROR_UNINITIALIZED;
    int i = dev_index(d);
    if (i < 0)
        return -NVML_ERROR_INVALID_ARGUMENT;
    if (__atomic_load_n(&g_sim.hdr->devices[i].lost, __ATOMIC_RELAXED))
        return -NVML_ERROR_GPU_IS_LOST;
    return i;
}

/* ---- cost model ----
 *
 * `gpuwatch sim up --nvml-cost h100-580` (header.nvml_cost): every NVML call burns, as busy
 * CPU in the calling thread, what the call cost on an H100 with driver 580 (nvml_bench, 200
 * calls each, 4 processes on the GPU: ../shared/real-gpu/README.md section 3; CPU time =
 * wall time there, the driver's ioctls are CPU-bound). Measured: ProcessUtilization 1,806 us,
 * ComputeRunningProcesses 83 us, MemoryInfo v2 7.7 us, RemappedRows / TotalEccErrors 1.8 us,
 * Temperature / PowerUsage / UtilizationRates 1.1-1.3 us. Assumed (not measured): the v1/v2
 * variants and ProcessesUtilizationInfo cost what the measured call does, the graphics and
 * MPS process lists what the compute list does (the same RM query), everything else 1 us.
 * Init, shutdown and nvmlErrorString cost nothing extra. The burn counts the call's own work
 * (the cost is a floor on the call's thread CPU time, not added on top). Default off. */
#define COST_PROCESS_UTILIZATION_NS 1806000u
#define COST_RUNNING_PROCESSES_NS 83000u
#define COST_MEMORY_INFO_NS 7700u
#define COST_ECC_NS 1800u
#define COST_SCALAR_NS 1200u
#define COST_OTHER_NS 1000u
/* Modelled, not measured (issue 19): nvmlDeviceGetFieldValues costs what a scalar query does
 * (1.2 us) per field it is asked for -- each field is its own RM control in the driver -- and
 * at least the 1 us of any call. ClockInfo and Encoder/DecoderUtilization are "everything else". */
#define COST_FIELD_NS 1200u

struct cost_guard {
    uint64_t start_ns;
    uint32_t cost_ns; /* 0: no cost model, or a call made inside another NVML call */
};

/* this thread's CPU inside NVML calls while the cost model is on (gpuwatchsim_nvml_thread_cpu_ns),
 * and how deep in NVML calls it is (a call made by another, e.g. GetCount -> GetCount_v2,
 * neither burns nor counts again) */
static __thread uint64_t t_nvml_cpu_ns;
static __thread unsigned t_nvml_depth;

static uint64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static inline struct cost_guard cost_begin(uint32_t cost_ns)
{
    struct cost_guard g = {0, 0};
    if (t_nvml_depth++ == 0 && g_mapped &&
        __atomic_load_n(&g_sim.hdr->nvml_cost, __ATOMIC_RELAXED) == SIM_NVML_COST_H100_580) {
        g.cost_ns = cost_ns;
        g.start_ns = thread_cpu_ns();
    }
    return g;
}

static volatile uint64_t g_cost_sink;

/* runs when the call returns (cleanup attribute): spin until the call has used its cost */
static void cost_end(struct cost_guard *g)
{
    t_nvml_depth--;
    if (!g->cost_ns)
        return;
    uint64_t until = g->start_ns + g->cost_ns, now;
    uint64_t x = g_cost_sink;
    while ((now = thread_cpu_ns()) < until)
        for (int k = 0; k < 64; k++)
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    g_cost_sink = x;
    t_nvml_cpu_ns += now - g->start_ns;
}

/* The calling thread's CPU spent inside NVML calls while the cost model was on (ns): what the
 * modelled driver cost this thread (benchmarks/bench_pipeline.py reads it around each sweep). */
API unsigned long long gpuwatchsim_nvml_thread_cpu_ns(void)
{
    return t_nvml_cpu_ns;
}

#define NVML_COST(ns) __attribute__((cleanup(cost_end))) struct cost_guard nvml_cost_guard_ = cost_begin(ns)

#define DEV_OR_RETURN(var, handle)      \
    int var = check_dev(handle);        \
    if (var < 0)                        \
        return -var

static void copy_str(char *dst, unsigned int len, const char *src)
{
    if (len == 0)
        return;
    snprintf(dst, len, "%s", src);
}

static nvmlReturn_t put_str(char *dst, unsigned int len, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    copy_str(dst, len, src);
    return NVML_SUCCESS;
}

/* ---- init / shutdown ---- */

/* a forked child gets its own open file description (flock locks belong to it) */
static void atfork_child(void)
{
    pthread_mutex_init(&g_lock, NULL);
    pthread_mutex_init(&g_scratch_lock, NULL);
    sim_after_fork_child();
    if (g_mapped && sim_reopen(sim_state_path(), &g_sim, 1) < 0)
        g_init_count = 0;
}

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&g_lock);
    if (!g_mapped) {
        int rc = sim_open(sim_state_path(), &g_sim);
        if (rc < 0) {
            pthread_mutex_unlock(&g_lock);
            return NVML_ERROR_DRIVER_NOT_LOADED;
        }
        for (int i = 0; i < SIM_MAX_DEVICES; i++)
            g_devices[i].index = (unsigned)i;
        pthread_atfork(NULL, NULL, atfork_child);
        g_mapped = 1;
    } else if (g_init_count == 0 && !sim_is_current(sim_state_path(), &g_sim)) {
        /* the node was re-created since the last init (like a driver reload): follow
         * it. The old mapping is left in place for threads that may still read it. */
        if (sim_reopen(sim_state_path(), &g_sim, 0) < 0) {
            pthread_mutex_unlock(&g_lock);
            return NVML_ERROR_DRIVER_NOT_LOADED;
        }
    }
    sim_self_identity(&g_self);
    g_init_count++;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
API nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

API nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_lock);
    if (!g_init_count) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    g_init_count--;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

API const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case 13: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

/* ---- system ---- */

API nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int len)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    return put_str(v, len, g_sim.hdr->driver_version);
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *v, unsigned int len)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    char buf[64];
    snprintf(buf, sizeof(buf), "12.%s", g_sim.hdr->driver_version);
    return put_str(v, len, buf);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = (int)g_sim.hdr->cuda_driver_version;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { NVML_COST(COST_OTHER_NS); return nvmlSystemGetCudaDriverVersion(v); }

API nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int len)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!name || len == 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%u/cmdline", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NVML_ERROR_NOT_FOUND;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return NVML_ERROR_NOT_FOUND;
    buf[n] = 0;
    copy_str(name, len, buf);
    return NVML_SUCCESS;
}

/* ---- device enumeration ---- */

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = g_sim.hdr->device_count;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { NVML_COST(COST_OTHER_NS); return nvmlDeviceGetCount_v2(count); }

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *dev)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!dev || index >= g_sim.hdr->device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g_sim.hdr->devices[index].lost)
        return NVML_ERROR_GPU_IS_LOST;
    *dev = &g_devices[index];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *dev)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetHandleByIndex_v2(index, dev);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *dev)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < g_sim.hdr->device_count; i++) {
        if (strcmp(g_sim.hdr->devices[i].uuid, uuid) == 0) {
            *dev = &g_devices[i];
            return g_sim.hdr->devices[i].lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

API nvmlReturn_t nvmlDeviceGetHandleBySerial(const char *serial, nvmlDevice_t *dev)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!serial || !dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < g_sim.hdr->device_count; i++) {
        if (strcmp(g_sim.hdr->devices[i].serial, serial) == 0) {
            *dev = &g_devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* accepts "00000000:1B:00.0", "0000:1B:00.0" and case variations */
static int bus_of(const char *id)
{
    const char *c = strchr(id, ':');
    if (!c)
        return -1;
    return (int)strtol(c + 1, NULL, 16);
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *id, nvmlDevice_t *dev)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!id || !dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    int bus = bus_of(id);
    for (unsigned i = 0; i < g_sim.hdr->device_count; i++) {
        if ((int)g_sim.hdr->devices[i].pci_bus == bus) {
            *dev = &g_devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *id, nvmlDevice_t *dev)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetHandleByPciBusId_v2(id, dev);
}

/* ---- identity ---- */

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)i;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int len)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    return put_str(name, len, g_sim.hdr->devices[i].name);
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int len)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    return put_str(uuid, len, g_sim.hdr->devices[i].uuid);
}

API nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t d, char *serial, unsigned int len)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    return put_str(serial, len, g_sim.hdr->devices[i].serial);
}

API nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t d, char *v, unsigned int len)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    return put_str(v, len, "96.00.99.00.01-sim");
}

API nvmlReturn_t nvmlDeviceGetBoardPartNumber(nvmlDevice_t d, char *v, unsigned int len)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    return put_str(v, len, "gpuwatch-sim");
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minor = g_sim.hdr->devices[i].minor;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t d, unsigned int *brand)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!brand)
        return NVML_ERROR_INVALID_ARGUMENT;
    *brand = 14; /* NVML_BRAND_NVIDIA */
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t d, unsigned int *arch)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!arch)
        return NVML_ERROR_INVALID_ARGUMENT;
    *arch = g_sim.hdr->devices[i].cc_major >= 9 ? 9 /* HOPPER */ : 7 /* AMPERE */;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = (int)g_sim.hdr->devices[i].cc_major;
    *minor = (int)g_sim.hdr->devices[i].cc_minor;
    return NVML_SUCCESS;
}

static void fill_pci(int i, unsigned int *domain, unsigned int *bus, unsigned int *device,
                     unsigned int *dev_id, unsigned int *subsys)
{
    *domain = 0;
    *bus = g_sim.hdr->devices[i].pci_bus;
    *device = 0;
    *dev_id = 0x233010deu;  /* H100 SXM5 device id | NVIDIA vendor id */
    *subsys = 0x16c110deu;
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof(*pci));
    fill_pci(i, &pci->domain, &pci->bus, &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId);
    snprintf(pci->busId, sizeof(pci->busId), "%s", g_sim.hdr->devices[i].pci_bus_id);
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0", pci->domain, pci->bus,
             pci->device);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_v2_t *pci)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof(*pci));
    fill_pci(i, &pci->domain, &pci->bus, &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId);
    snprintf(pci->busId, sizeof(pci->busId), "%04X:%02X:%02X.0", pci->domain, pci->bus, pci->device);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t d, nvmlPciInfo_v2_t *pci)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetPciInfo_v2(d, pci);
}

API nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned int *v)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = 5;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *v)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetCurrPcieLinkGeneration(d, v);
}

API nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *v)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = 16;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *v)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetCurrPcieLinkWidth(d, v);
}

/* ---- counters that integrate load (energy, PCIe and NVLink bytes) ----
 * A real driver integrates its power samples into the energy counter and counts every PCIe /
 * NVLink byte. The fake integrates, per reading process and device, the power it answers
 * (idle + (limit - idle) x utilisation) and traffic rates proportional to the utilisation over
 * [previous read, now] (the busy buckets, at most their 6.4 s history). A process's first read
 * starts from the node's creation at idle power and idle PCIe traffic, so every reader sees
 * counters that start near the same origin and only grow; two processes' counters differ by
 * what each integrated (the real counters are one per GPU). */
#define SIM_IDLE_POWER_MW 70000ULL
#define SIM_PCIE_IDLE_BPS 2000000ULL        /* 2 MB/s each way: driver and monitoring traffic */
#define SIM_PCIE_TX_BUSY_BPS 2000000000ULL  /* at 100 % busy: results copied back to the host */
#define SIM_PCIE_RX_BUSY_BPS 6000000000ULL  /* at 100 % busy: inputs copied in */
#define SIM_NVLINK_BUSY_BPS 50000000000ULL  /* each way at 100 % busy: peer traffic of a sharded job */

static unsigned current_util(int i);
static unsigned device_util_pct(int i, uint64_t from_ns, uint64_t to_ns);

struct sim_traffic {
    uint64_t last_ns; /* 0: not read yet in this process */
    double energy_mj, pcie_tx_bytes, pcie_rx_bytes, nvlink_tx_bytes, nvlink_rx_bytes;
};
static struct sim_traffic g_traffic[SIM_MAX_DEVICES];
static pthread_mutex_t g_traffic_mu = PTHREAD_MUTEX_INITIALIZER;

/* device i's counters integrated up to now (copied out under the lock) */
static struct sim_traffic sim_traffic_now(int i)
{
    uint64_t now = sim_realtime_ns();
    const struct sim_device *dev = &g_sim.hdr->devices[i];
    double limit_mw = (double)dev->power_limit_mw;
    pthread_mutex_lock(&g_traffic_mu);
    struct sim_traffic *t = &g_traffic[i];
    if (t->last_ns == 0) {
        uint64_t created_ns = g_sim.hdr->created_us * 1000ULL;
        double up_s = now > created_ns ? (double)(now - created_ns) / 1e9 : 0.0;
        t->energy_mj = (double)dev->energy_mj_base + up_s * (double)SIM_IDLE_POWER_MW;
        t->pcie_tx_bytes = t->pcie_rx_bytes = up_s * (double)SIM_PCIE_IDLE_BPS;
        t->last_ns = now;
    } else if (now > t->last_ns) {
        uint64_t history_ns = SIM_BUCKETS * SIM_BUCKET_NS;
        uint64_t from = now - t->last_ns > history_ns ? now - history_ns : t->last_ns;
        double busy = device_util_pct(i, from, now) / 100.0;
        double dt_s = (double)(now - t->last_ns) / 1e9;
        t->energy_mj += dt_s * ((double)SIM_IDLE_POWER_MW + (limit_mw - (double)SIM_IDLE_POWER_MW) * busy);
        t->pcie_tx_bytes += dt_s * ((double)SIM_PCIE_IDLE_BPS + (double)SIM_PCIE_TX_BUSY_BPS * busy);
        t->pcie_rx_bytes += dt_s * ((double)SIM_PCIE_IDLE_BPS + (double)SIM_PCIE_RX_BUSY_BPS * busy);
        t->nvlink_tx_bytes += dt_s * (double)SIM_NVLINK_BUSY_BPS * busy;
        t->nvlink_rx_bytes += dt_s * (double)SIM_NVLINK_BUSY_BPS * busy;
        t->last_ns = now;
    }
    struct sim_traffic out = *t;
    pthread_mutex_unlock(&g_traffic_mu);
    return out;
}

API nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t d, unsigned int counter, unsigned int *v)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!v || counter > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* KB/s over the last utilisation window: the rates sim_traffic_bytes integrates */
    unsigned util = current_util(i);
    uint64_t rate = counter == 0 ? SIM_PCIE_TX_BUSY_BPS : SIM_PCIE_RX_BUSY_BPS;
    *v = (unsigned)((SIM_PCIE_IDLE_BPS + rate * util / 100) / 1000);
    return NVML_SUCCESS;
}

/* ---- liveness cache ----
 * One sweep of a monitoring agent asks several per-device questions in a row (memory,
 * processes, utilisation on every GPU); parsing /proc/locks for each one made the fake
 * driver cost ~35 ms per sweep with 800 processes. One parse now serves the questions
 * asked within LIVE_CACHE_NS. A slot the cache saw alive, with the same claim
 * generation, is trusted for that long (a process that died inside the window is listed
 * at most that much longer: the real driver also lags process exit); every other slot
 * is re-checked with F_GETLK, so a slot is never reaped on stale information. */
#define LIVE_CACHE_NS 200000000ULL
static struct sim_live g_live_cache;
static uint64_t g_live_cache_gen[SIM_MAX_PROCS];
static uint64_t g_live_cache_ns;
static pthread_mutex_t g_live_cache_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void live_cached(struct sim_live *out)
{
    uint64_t now = monotonic_ns();
    pthread_mutex_lock(&g_live_cache_mu);
    if (g_live_cache_ns == 0 || now - g_live_cache_ns >= LIVE_CACHE_NS) {
        sim_liveness(&g_sim, &g_self, &g_live_cache);
        for (uint32_t s = 0; s < g_live_cache.count; s++)
            g_live_cache_gen[s] = __atomic_load_n(&g_sim.hdr->procs[s].generation, __ATOMIC_ACQUIRE);
        g_live_cache_ns = now;
        *out = g_live_cache;
        pthread_mutex_unlock(&g_live_cache_mu);
        return;
    }
    uint32_t hw = g_sim.hdr->proc_high_water;
    out->count = hw > SIM_MAX_PROCS ? SIM_MAX_PROCS : hw;
    for (uint32_t s = 0; s < out->count; s++) {
        struct sim_proc *p = &g_sim.hdr->procs[s];
        if (!__atomic_load_n(&p->in_use, __ATOMIC_ACQUIRE))
            out->pid[s] = -1;
        else if (s < g_live_cache.count && g_live_cache.pid[s] >= 0 &&
                 g_live_cache_gen[s] == __atomic_load_n(&p->generation, __ATOMIC_ACQUIRE))
            out->pid[s] = g_live_cache.pid[s];
        else
            out->pid[s] = sim_slot_owner(&g_sim, (int)s, &g_self);
    }
    pthread_mutex_unlock(&g_live_cache_mu);
}

/* ---- memory ---- */

/* Free the slots of processes found dead (exclusive lock, liveness re-checked), so
 * later queries do not re-confirm them one F_GETLK each. Their busy history stays
 * until the slot is reused, so utilisation still counts work they did. */
static void reap_dead(void)
{
    struct sim_live *live = malloc(sizeof(*live));
    if (!live)
        return;
    sim_lock(&g_sim, 1);
    sim_liveness(&g_sim, &g_self, live);
    for (uint32_t s = 0; s < live->count; s++)
        if (live->pid[s] < 0 && g_sim.hdr->procs[s].in_use)
            __atomic_store_n(&g_sim.hdr->procs[s].in_use, 0, __ATOMIC_RELEASE);
    sim_unlock(&g_sim);
    free(live);
}

static unsigned count_dead(const struct sim_live *live)
{
    unsigned dead = 0;
    for (uint32_t s = 0; s < live->count; s++)
        if (live->pid[s] < 0 && g_sim.hdr->procs[s].in_use)
            dead++;
    return dead;
}

static uint64_t used_bytes(int i)
{
    struct sim_live *live = malloc(sizeof(*live));
    if (!live)
        return 0;
    sim_lock(&g_sim, 0);
    live_cached(live);
    uint64_t used = sim_used_bytes_live(&g_sim, i, live, 0);
    unsigned dead = count_dead(live);
    sim_unlock(&g_sim);
    free(live);
    if (dead)
        reap_dead();
    uint64_t total = g_sim.hdr->devices[i].memory_total_bytes;
    return used > total ? total : used;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    NVML_COST(COST_MEMORY_INFO_NS);
    DEV_OR_RETURN(i, d);
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t total = g_sim.hdr->devices[i].memory_total_bytes, used = used_bytes(i);
    m->total = total;
    m->used = used;
    m->free = total - used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    NVML_COST(COST_MEMORY_INFO_NS);
    DEV_OR_RETURN(i, d);
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    uint64_t total = g_sim.hdr->devices[i].memory_total_bytes, used = used_bytes(i);
    m->total = total;
    m->reserved = 0;
    m->used = used;
    m->free = total - used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t d, nvmlBAR1Memory_t *m)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    m->bar1Total = 128ULL << 30;
    m->bar1Used = 2ULL << 20;
    m->bar1Free = m->bar1Total - m->bar1Used;
    return NVML_SUCCESS;
}

/* ---- process samples ----
 *
 * What the real driver does (open-gpu-kernel-modules: NV2080_CTRL_PERF_GPUMON_PERFMON_UTIL_SAMPLE,
 * src/nvidia/src/kernel/diagnostics/gpu_acct.c): RM keeps a ring of 72 samples per GPU, one per
 * sample period; each has one timestamp, the engine's busy percentage over that period and
 * the pid that was active on the engine when it was taken. nvmlDeviceGetProcessUtilization
 * returns the samples newer than lastSeenTimeStamp (NOT_FOUND when none is), so a process
 * gets a sample only for periods in which it ran.
 *
 * The fake keeps the same ring per (process, device) -- busy microseconds per period, filled
 * by the stub's kernel launches (simstate.h "Sample ring") -- and answers with one sample per
 * (period, process that ran in it): timestamp = the period's end (CLOCK_REALTIME us),
 * smUtil = that process's busy share of the period (integer percent, as NVML's), memUtil =
 * smUtil / 2. A period in which several processes ran gives each of them a sample with the
 * same timestamp (they overlap); on a time-sliced GPU their shares add up to at most 100
 * (the engine runs one context at a time), in the MPS-like mode to at most 100 x lanes. An
 * idle period gives no sample. The real driver names one process per sample (the one active
 * when it was taken) with the whole engine's busy share; the fake splits the period by who
 * ran, which is what the samples of several periods average to and what the H100 recording
 * showed as overlapping samples (../shared/real-gpu/README.md section 2). A period is
 * published SIM_SAMPLE_PUBLISH_GUARD_NS after it ends. Samples of processes that have exited
 * are not returned (the fake learns a host pid from the liveness lock, gone at exit; the real
 * ring keeps them until overwritten). Per call: one pass over the process slots, at most
 * SIM_SAMPLE_RING periods each. */

struct util_sample {
    unsigned pid;
    unsigned sm;
    unsigned long long ts_us;
};

static struct util_sample *g_samples; /* guarded by g_scratch_lock; grows as needed */
static size_t g_samples_cap;

static int push_sample(size_t n, unsigned pid, unsigned long long ts_us, unsigned sm)
{
    if (n >= g_samples_cap) {
        size_t cap = g_samples_cap ? g_samples_cap * 2 : 1024;
        struct util_sample *grown = realloc(g_samples, cap * sizeof(*grown));
        if (!grown)
            return -1;
        g_samples = grown;
        g_samples_cap = cap;
    }
    g_samples[n].pid = pid;
    g_samples[n].ts_us = ts_us;
    g_samples[n].sm = sm;
    return 0;
}

/* end of period k, in microseconds (the sample's timestamp) */
static unsigned long long period_end_us(uint64_t k, uint64_t period_ns)
{
    return (unsigned long long)(((k + 1) * period_ns) / 1000ULL);
}

static unsigned sim_samples(int i, unsigned long long last_seen_us, uint64_t now_ns, size_t *count,
                            size_t *headroom)
{
    uint64_t period_ns = sim_sample_period_ns(g_sim.hdr);
    *count = 0;
    *headroom = 0;
    if (now_ns < period_ns + SIM_SAMPLE_PUBLISH_GUARD_NS)
        return 0;
    uint64_t k_last = (now_ns - SIM_SAMPLE_PUBLISH_GUARD_NS) / period_ns; /* first unpublished */
    if (k_last == 0)
        return 0;
    k_last--;
    uint64_t k_first = k_last >= SIM_SAMPLE_RING - 1 ? k_last - (SIM_SAMPLE_RING - 1) : 0;
    if (last_seen_us) {
        uint64_t k = ((uint64_t)last_seen_us * 1000ULL) / period_ns; /* end(k) > last_seen */
        while (k > 0 && period_end_us(k - 1, period_ns) > last_seen_us)
            k--;
        while (period_end_us(k, period_ns) <= last_seen_us)
            k++;
        if (k > k_first)
            k_first = k;
    }
    if (k_first > k_last)
        return 0;
    double period_us = (double)period_ns / 1000.0;
    size_t n = 0;
    sim_lock(&g_sim, 0);
    live_cached(&g_live);
    for (uint32_t s = 0; s < g_live.count; s++) {
        struct sim_proc *p = &g_sim.hdr->procs[s];
        if (!p->in_use || g_live.pid[s] < 0)
            continue;
        if (!((p->context_mask >> i) & 1u) && p->memory_bytes[i] == 0)
            continue;
        (*headroom)++; /* it may get a sample in the next period published */
        for (uint64_t k = k_first; k <= k_last; k++) {
            uint32_t busy = sim_sample_busy_us(p, i, k);
            if (!busy)
                continue;
            double pct = (double)busy * 100.0 / period_us + 0.5;
            unsigned sm = pct >= 100.0 ? 100u : (unsigned)pct;
            if (push_sample(n, (unsigned)g_live.pid[s], period_end_us(k, period_ns), sm) < 0)
                break;
            n++;
        }
    }
    sim_unlock(&g_sim);
    *count = n;
    return 0;
}

/* ---- replay: the per-process calls answered from a recorded NVML stream ----
 *
 * `gpuwatch sim replay-nvml FILE` compiles a recording (gpuwatch/sim/nvml_replay.py,
 * RECORDING.md) into a flat little-endian file and names it in the state header with an
 * origin time. From then on, for the recorded devices, nvmlDeviceGetProcessUtilization /
 * ...ProcessesUtilizationInfo, nvmlDeviceGetComputeRunningProcesses* and
 * nvmlDeviceGetUtilizationRates answer what the recorded GPU answered, time-shifted so the
 * recording's start is the origin: a sample is visible once its shifted timestamp has
 * passed, a process list or utilisation is the latest recorded at or before now. Before the
 * first record and after the last a device answers as an idle GPU. Graphics/MPS lists are
 * empty; memory, temperature, power and the rest stay the simulated node's. */

#define REPLAY_MAGIC "GWNVRP01"
struct rp_header {
    char magic[8];
    uint32_t version, device_count;
    uint64_t duration_us;
    uint32_t n_samples, n_proc_snaps, n_proc_entries, n_util_snaps;
};
struct rp_sample {
    uint64_t ts_rel_us;
    uint32_t device, pid, sm, mem;
};
struct rp_proc_snap {
    uint64_t wall_rel_us;
    uint32_t device, count, first, pad;
};
struct rp_proc_entry {
    uint64_t used_bytes;
    uint32_t pid, pad;
};
struct rp_util_snap {
    uint64_t wall_rel_us;
    uint32_t device, gpu, memory, pad;
};
_Static_assert(sizeof(struct rp_header) == 40, "replay header 40 bytes");
_Static_assert(sizeof(struct rp_sample) == 24, "replay sample 24 bytes");
_Static_assert(sizeof(struct rp_proc_snap) == 24, "replay process list 24 bytes");
_Static_assert(sizeof(struct rp_proc_entry) == 16, "replay process 16 bytes");
_Static_assert(sizeof(struct rp_util_snap) == 24, "replay utilisation 24 bytes");

#define REPLAY_HEADROOM_US 1000000ULL /* a size query counts the samples of the next second too */

struct replay {
    char path[SIM_PATH_LEN];
    uint64_t origin_us;
    void *map;
    size_t len;
    const struct rp_header *h;
    const struct rp_sample *samples;
    const struct rp_proc_snap *snaps;
    const struct rp_proc_entry *entries;
    const struct rp_util_snap *utils;
};
static struct replay g_replay;
static pthread_mutex_t g_replay_mu = PTHREAD_MUTEX_INITIALIZER;

/* the replay in force (NULL: none), (re)mapped when the header names another file.
 * The mapping of a replaced file is kept (a concurrent caller may still read it). */
static const struct replay *replay_current(void)
{
    const char *path = g_sim.hdr->replay_path;
    if (!path[0])
        return NULL;
    uint64_t origin = __atomic_load_n(&g_sim.hdr->replay_origin_us, __ATOMIC_ACQUIRE);
    pthread_mutex_lock(&g_replay_mu);
    if (g_replay.map && g_replay.origin_us == origin && strncmp(g_replay.path, path, SIM_PATH_LEN) == 0) {
        pthread_mutex_unlock(&g_replay_mu);
        return &g_replay;
    }
    memset(&g_replay, 0, sizeof(g_replay));
    snprintf(g_replay.path, sizeof(g_replay.path), "%.*s", SIM_PATH_LEN - 1, path);
    g_replay.origin_us = origin;
    int fd = open(g_replay.path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0 || (size_t)st.st_size < sizeof(struct rp_header)) {
        if (fd >= 0)
            close(fd);
        pthread_mutex_unlock(&g_replay_mu);
        return NULL;
    }
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd); /* not the state file: closing it drops no liveness lock */
    if (m == MAP_FAILED) {
        pthread_mutex_unlock(&g_replay_mu);
        return NULL;
    }
    const struct rp_header *h = m;
    size_t need = sizeof(*h) + (size_t)h->n_samples * sizeof(struct rp_sample) +
                  (size_t)h->n_proc_snaps * sizeof(struct rp_proc_snap) +
                  (size_t)h->n_proc_entries * sizeof(struct rp_proc_entry) +
                  (size_t)h->n_util_snaps * sizeof(struct rp_util_snap);
    if (memcmp(h->magic, REPLAY_MAGIC, 8) != 0 || h->version != 1 || need > (size_t)st.st_size) {
        munmap(m, (size_t)st.st_size);
        pthread_mutex_unlock(&g_replay_mu);
        return NULL;
    }
    g_replay.map = m;
    g_replay.len = (size_t)st.st_size;
    g_replay.h = h;
    g_replay.samples = (const struct rp_sample *)(h + 1);
    g_replay.snaps = (const struct rp_proc_snap *)(g_replay.samples + h->n_samples);
    g_replay.entries = (const struct rp_proc_entry *)(g_replay.snaps + h->n_proc_snaps);
    g_replay.utils = (const struct rp_util_snap *)(g_replay.entries + h->n_proc_entries);
    pthread_mutex_unlock(&g_replay_mu);
    return &g_replay;
}

/* now relative to the replay's origin (us); -1 before the origin or after the recording */
static int64_t replay_now_rel(const struct replay *r)
{
    uint64_t now_us = sim_realtime_ns() / 1000ULL;
    if (now_us < r->origin_us || now_us - r->origin_us > r->h->duration_us)
        return -1;
    return (int64_t)(now_us - r->origin_us);
}

static void replay_samples(const struct replay *r, int i, unsigned long long last_seen_us, size_t *count,
                           size_t *headroom)
{
    *count = 0;
    *headroom = 0;
    uint64_t now_us = sim_realtime_ns() / 1000ULL;
    if (now_us < r->origin_us)
        return;
    uint64_t now_rel = now_us - r->origin_us;
    uint64_t seen_rel = last_seen_us > r->origin_us ? last_seen_us - r->origin_us : 0;
    size_t n = 0;
    for (uint32_t k = 0; k < r->h->n_samples; k++) { /* sorted by (device, time) */
        const struct rp_sample *s = &r->samples[k];
        if (s->device != (uint32_t)i)
            continue;
        if (s->ts_rel_us > now_rel) {
            for (; k < r->h->n_samples && r->samples[k].device == (uint32_t)i &&
                   r->samples[k].ts_rel_us <= now_rel + REPLAY_HEADROOM_US;
                 k++)
                (*headroom)++;
            break;
        }
        if (last_seen_us && s->ts_rel_us <= seen_rel)
            continue;
        if (push_sample(n, s->pid, r->origin_us + s->ts_rel_us, s->sm) < 0)
            break;
        n++;
    }
    *count = n;
}

/* the latest recorded process list of device i at or before now (NULL: none) */
static const struct rp_proc_snap *replay_procs(const struct replay *r, int i)
{
    int64_t now_rel = replay_now_rel(r);
    if (now_rel < 0)
        return NULL;
    const struct rp_proc_snap *found = NULL;
    for (uint32_t k = 0; k < r->h->n_proc_snaps; k++) {
        const struct rp_proc_snap *s = &r->snaps[k];
        if (s->device == (uint32_t)i && s->wall_rel_us <= (uint64_t)now_rel)
            found = s;
        else if (s->device > (uint32_t)i || (s->device == (uint32_t)i && s->wall_rel_us > (uint64_t)now_rel))
            break;
    }
    return found;
}

static int replay_util(const struct replay *r, int i, nvmlUtilization_t *u)
{
    int64_t now_rel = replay_now_rel(r);
    u->gpu = u->memory = 0;
    if (now_rel < 0)
        return 0;
    for (uint32_t k = 0; k < r->h->n_util_snaps; k++) {
        const struct rp_util_snap *s = &r->utils[k];
        if (s->device == (uint32_t)i && s->wall_rel_us <= (uint64_t)now_rel) {
            u->gpu = s->gpu;
            u->memory = s->memory;
        } else if (s->device > (uint32_t)i || (s->device == (uint32_t)i && s->wall_rel_us > (uint64_t)now_rel)) {
            break;
        }
    }
    return 0;
}

/* ---- processes ---- */

struct live_proc {
    int host_pid;
    int slot;
    uint64_t memory_bytes;
};

/* live processes with a context or memory on device i; returns how many (<= cap) */
static unsigned collect_procs(int i, struct live_proc *out, unsigned cap)
{
    unsigned n = 0;
    sim_lock(&g_sim, 0);
    live_cached(&g_live);
    for (uint32_t s = 0; s < g_live.count && n < cap; s++) {
        struct sim_proc *p = &g_sim.hdr->procs[s];
        if (!p->in_use)
            continue;
        if (!((p->context_mask >> i) & 1u) && p->memory_bytes[i] == 0)
            continue;
        int pid = g_live.pid[s];
        if (pid < 0)
            continue; /* dead: its memory is gone, as on a real GPU */
        out[n].host_pid = pid;
        out[n].slot = (int)s;
        out[n].memory_bytes = p->memory_bytes[i];
        n++;
    }
    unsigned dead = count_dead(&g_live);
    sim_unlock(&g_sim);
    if (dead)
        reap_dead();
    return n;
}

static struct live_proc g_scratch[SIM_MAX_PROCS];

static nvmlReturn_t running_processes(nvmlDevice_t d, unsigned int *count, void *infos, int layout)
{
    DEV_OR_RETURN(i, d);
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_scratch_lock);
    unsigned n;
    const struct replay *r = replay_current();
    if (r && (uint32_t)i < r->h->device_count) {
        const struct rp_proc_snap *snap = replay_procs(r, i);
        n = 0;
        for (uint32_t k = 0; snap && k < snap->count && snap->first + k < r->h->n_proc_entries && n < SIM_MAX_PROCS;
             k++, n++) {
            g_scratch[n].host_pid = (int)r->entries[snap->first + k].pid;
            g_scratch[n].slot = -1;
            g_scratch[n].memory_bytes = r->entries[snap->first + k].used_bytes;
        }
    } else {
        n = collect_procs(i, g_scratch, SIM_MAX_PROCS);
    }
    nvmlReturn_t rc = NVML_SUCCESS;
    if (*count < n || (n > 0 && !infos)) {
        *count = n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (unsigned k = 0; k < n; k++) {
            if (layout == 1) {
                nvmlProcessInfo_v1_t *a = infos;
                a[k].pid = (unsigned)g_scratch[k].host_pid;
                a[k].usedGpuMemory = g_scratch[k].memory_bytes;
            } else {
                nvmlProcessInfo_t *a = infos;
                a[k].pid = (unsigned)g_scratch[k].host_pid;
                a[k].usedGpuMemory = g_scratch[k].memory_bytes;
                a[k].gpuInstanceId = 0xffffffffu;
                a[k].computeInstanceId = 0xffffffffu;
            }
        }
        *count = n;
    }
    pthread_mutex_unlock(&g_scratch_lock);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    NVML_COST(COST_RUNNING_PROCESSES_NS);
    return running_processes(d, c, p, 3);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    NVML_COST(COST_RUNNING_PROCESSES_NS);
    return running_processes(d, c, p, 2);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v1_t *p)
{
    NVML_COST(COST_RUNNING_PROCESSES_NS);
    return running_processes(d, c, p, 1);
}

/* the simulated node runs compute work only: graphics and MPS lists are empty */
static nvmlReturn_t no_processes(nvmlDevice_t d, unsigned int *count)
{
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    NVML_COST(COST_RUNNING_PROCESSES_NS);
    (void)p;
    return no_processes(d, c);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    NVML_COST(COST_RUNNING_PROCESSES_NS);
    (void)p;
    return no_processes(d, c);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v1_t *p)
{
    NVML_COST(COST_RUNNING_PROCESSES_NS);
    (void)p;
    return no_processes(d, c);
}

API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    NVML_COST(COST_RUNNING_PROCESSES_NS);
    (void)p;
    return no_processes(d, c);
}

/* ---- utilisation ---- */

/* busy share of device i in [from_ns, to_ns], summed over processes, clamped to 100 */
static unsigned util_pct_of(struct sim_handle *h, int i, uint64_t from_ns, uint64_t to_ns)
{
    uint64_t busy_us = 0;
    uint32_t hw = h->hdr->proc_high_water;
    for (uint32_t s = 0; s < hw && s < SIM_MAX_PROCS; s++) {
        /* every slot, in use or not: busy time of a process that died inside the
         * window still counts (it ran); a reused slot starts with an empty history */
        busy_us += sim_slot_busy_us(&h->hdr->procs[s], i, from_ns, to_ns);
    }
    uint64_t window_us = (to_ns - from_ns) / 1000;
    uint64_t pct = window_us ? (busy_us * 100 + window_us / 2) / window_us : 0;
    return pct > 100 ? 100 : (unsigned)pct;
}

static unsigned device_util_pct(int i, uint64_t from_ns, uint64_t to_ns)
{
    sim_lock(&g_sim, 0);
    unsigned pct = util_pct_of(&g_sim, i, from_ns, to_ns);
    sim_unlock(&g_sim);
    return pct;
}

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    NVML_COST(COST_SCALAR_NS);
    DEV_OR_RETURN(i, d);
    if (!u)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct replay *r = replay_current();
    if (r && (uint32_t)i < r->h->device_count)
        return replay_util(r, i, u) == 0 ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
    uint64_t now = sim_realtime_ns();
    unsigned gpu = device_util_pct(i, now - UTIL_WINDOW_NS, now);
    u->gpu = gpu;
    u->memory = gpu / 2;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t d, unsigned int *util, unsigned int *period_us)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!util || !period_us)
        return NVML_ERROR_INVALID_ARGUMENT;
    *util = 0;
    *period_us = 1000000;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t d, unsigned int *util, unsigned int *period_us)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetEncoderUtilization(d, util, period_us);
}

/* Samples of device i newer than last_seen_us into g_samples (g_scratch_lock held). `headroom`:
 * how many more a call made a moment later may find (the next period's). A size query (NULL
 * array) answers n + headroom, so the usual two calls -- ask the size, then fill -- do not fail
 * with INSUFFICIENT_SIZE when a period is published between them (a period ends every 1/6 s;
 * the fill call then returns the count it wrote). */
static size_t collect_samples(int i, unsigned long long last_seen_us, size_t *headroom)
{
    size_t n = 0;
    const struct replay *r = replay_current();
    if (r && (uint32_t)i < r->h->device_count)
        replay_samples(r, i, last_seen_us, &n, headroom);
    else
        sim_samples(i, last_seen_us, sim_realtime_ns(), &n, headroom);
    return n;
}

API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *samples,
                                                 unsigned int *count, unsigned long long last_seen_us)
{
    NVML_COST(COST_PROCESS_UTILIZATION_NS);
    DEV_OR_RETURN(i, d);
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_scratch_lock);
    size_t headroom = 0;
    size_t n = collect_samples(i, last_seen_us, &headroom);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (n == 0) {
        *count = 0;
        rc = NVML_ERROR_NOT_FOUND; /* what the real driver says when no samples are newer */
    } else if (!samples || *count < n) {
        *count = (unsigned)(samples ? n : n + headroom);
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (size_t k = 0; k < n; k++) {
            samples[k].pid = g_samples[k].pid;
            samples[k].timeStamp = g_samples[k].ts_us;
            samples[k].smUtil = g_samples[k].sm;
            samples[k].memUtil = g_samples[k].sm / 2;
            samples[k].encUtil = 0;
            samples[k].decUtil = 0;
        }
        *count = (unsigned)n;
    }
    pthread_mutex_unlock(&g_scratch_lock);
    return rc;
}

API nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t d, nvmlProcessesUtilizationInfo_t *info)
{
    NVML_COST(COST_PROCESS_UTILIZATION_NS);
    DEV_OR_RETURN(i, d);
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlProcessesUtilizationInfo_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    pthread_mutex_lock(&g_scratch_lock);
    size_t headroom = 0;
    size_t n = collect_samples(i, info->lastSeenTimeStamp, &headroom);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (n == 0) {
        info->processSamplesCount = 0;
        rc = NVML_ERROR_NOT_FOUND;
    } else if (!info->procUtilArray || info->processSamplesCount < n) {
        info->processSamplesCount = (unsigned)(info->procUtilArray ? n : n + headroom);
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        unsigned long long newest = 0;
        for (size_t k = 0; k < n; k++) {
            nvmlProcessUtilizationInfo_v1_t *s = &info->procUtilArray[k];
            memset(s, 0, sizeof(*s));
            s->timeStamp = g_samples[k].ts_us;
            s->pid = g_samples[k].pid;
            s->smUtil = g_samples[k].sm;
            s->memUtil = g_samples[k].sm / 2;
            if (s->timeStamp > newest)
                newest = s->timeStamp;
        }
        info->processSamplesCount = (unsigned)n;
        info->lastSeenTimeStamp = newest;
    }
    pthread_mutex_unlock(&g_scratch_lock);
    return rc;
}

/* ---- thermals, power, clocks, modes ---- */

static unsigned current_util(int i)
{
    uint64_t now = sim_realtime_ns();
    return device_util_pct(i, now - UTIL_WINDOW_NS, now);
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, unsigned int sensor, unsigned int *temp)
{
    NVML_COST(COST_SCALAR_NS);
    DEV_OR_RETURN(i, d);
    if (!temp || sensor != 0 /* NVML_TEMPERATURE_GPU */)
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = 30 + (current_util(i) * 2) / 5;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t d, unsigned int type, unsigned int *temp)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!temp)
        return NVML_ERROR_INVALID_ARGUMENT;
    static const unsigned thresholds[] = {92, 89, 87, 83}; /* shutdown, slowdown, mem max, gpu max */
    if (type >= sizeof(thresholds) / sizeof(thresholds[0]))
        return NVML_ERROR_NOT_SUPPORTED;
    *temp = thresholds[type];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t d, unsigned int *speed)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    (void)speed;
    return NVML_ERROR_NOT_SUPPORTED; /* SXM boards have no fan of their own */
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw)
{
    NVML_COST(COST_SCALAR_NS);
    DEV_OR_RETURN(i, d);
    if (!mw)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned limit = g_sim.hdr->devices[i].power_limit_mw;
    unsigned idle = 70000;
    *mw = idle + (unsigned)((uint64_t)(limit - idle) * current_util(i) / 100);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t d, unsigned int *mw)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!mw)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mw = g_sim.hdr->devices[i].power_limit_mw;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned int *mw)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetPowerManagementLimit(d, mw);
}

API nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t d, unsigned int *mw)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetPowerManagementLimit(d, mw);
}

API nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t d, unsigned int *min_mw,
                                                              unsigned int *max_mw)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!min_mw || !max_mw)
        return NVML_ERROR_INVALID_ARGUMENT;
    *min_mw = 200000;
    *max_mw = g_sim.hdr->devices[i].power_limit_mw;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *mj)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!mj)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mj = (unsigned long long)sim_traffic_now(i).energy_mj; /* the power answered, integrated */
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t d, unsigned int *pstate)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!pstate)
        return NVML_ERROR_INVALID_ARGUMENT;
    *pstate = current_util(i) > 0 ? 0 : 8;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPowerState(nvmlDevice_t d, unsigned int *pstate)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetPerformanceState(d, pstate);
}

/* clock types: 0 graphics, 1 SM, 2 memory, 3 video */
API nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t d, unsigned int type, unsigned int *mhz)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!mhz || type > 3)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mhz = type == 2 ? g_sim.hdr->devices[i].mem_clock_max_mhz : g_sim.hdr->devices[i].sm_clock_max_mhz;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t d, unsigned int type, unsigned int *mhz)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (!mhz || type > 3)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (type == 2) {
        *mhz = g_sim.hdr->devices[i].mem_clock_max_mhz;
    } else {
        *mhz = current_util(i) > 0 ? g_sim.hdr->devices[i].sm_clock_max_mhz : 345;
    }
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t d, unsigned int *mode)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mode = 0; /* NVML_COMPUTEMODE_DEFAULT */
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t d, unsigned int *mode)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mode = 1;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetDisplayMode(nvmlDevice_t d, unsigned int *mode)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mode = 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetDisplayActive(nvmlDevice_t d, unsigned int *mode)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetDisplayMode(d, mode);
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    (void)current;
    (void)pending;
    return NVML_ERROR_NOT_SUPPORTED;
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t d, unsigned int *is_mig)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!is_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    *is_mig = 0;
    return NVML_SUCCESS;
}

/* driver models (WDDM/TCC) are Windows-only: real Linux drivers answer NOT_SUPPORTED */
API nvmlReturn_t nvmlDeviceGetCurrentDriverModel(nvmlDevice_t d, unsigned int *model)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    (void)model;
    return NVML_ERROR_NOT_SUPPORTED;
}

API nvmlReturn_t nvmlDeviceGetDriverModel(nvmlDevice_t d, unsigned int *current, unsigned int *pending)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    (void)current;
    (void)pending;
    return NVML_ERROR_NOT_SUPPORTED;
}

API nvmlReturn_t nvmlDeviceGetDriverModel_v2(nvmlDevice_t d, unsigned int *current, unsigned int *pending)
{
    NVML_COST(COST_OTHER_NS);
    return nvmlDeviceGetDriverModel(d, current, pending);
}

/* ---- field values ---- */

typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType;        /* nvmlValueType_t */
    nvmlReturn_t nvmlReturn;
    unsigned long long value; /* nvmlValue_t union, 8 bytes */
} nvmlFieldValue_t;
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t is 40 bytes");

#define NVML_FI_DEV_NVLINK_LINK_COUNT 91
#define NVML_FI_DEV_MEMORY_TEMP 82
#define NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION 83
#define NVML_FI_DEV_PCIE_REPLAY_COUNTER 94
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX 138
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX 139
#define NVML_FI_DEV_REMAPPED_COR 142
#define NVML_FI_DEV_REMAPPED_UNC 143
#define NVML_FI_DEV_REMAPPED_PENDING 144
#define NVML_FI_DEV_REMAPPED_FAILURE 145
#define NVML_FI_DEV_PCIE_COUNT_TX_BYTES 197
#define NVML_FI_DEV_PCIE_COUNT_RX_BYTES 198
#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3

/* Answered (per entry, as the real call does; the call itself succeeds):
 *   NVLink link count: 0 on a PCIe node, NVML_NVLINK_MAX_LINKS (H100 SXM) otherwise;
 *   memory temperature (HBM runs a few degrees above the core at load), total energy (mJ),
 *   PCIe replays (0: a healthy link), PCIe TX/RX bytes and NVLink data TX/RX (KiB; NOT_SUPPORTED
 *   on a PCIe node) -- counters that grow with load (sim_traffic_now) -- and the remapped-row
 *   counts of nvmlDeviceGetRemappedRows;
 *   every other field NOT_SUPPORTED, as the real call answers absent features.
 * Cost model: COST_FIELD_NS per field asked (modelled, see COST_FIELD_NS). */
API nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values)
{
    NVML_COST(count > 0 ? (uint32_t)count * COST_FIELD_NS : COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    if (count < 0 || (count > 0 && !values))
        return NVML_ERROR_INVALID_ARGUMENT;
    long long now_us = (long long)(sim_realtime_ns() / 1000ULL);
    int pcie = g_sim.hdr->topology == SIM_TOPO_PCIE;
    unsigned links = pcie ? 0u : (unsigned)SIM_NVLINK_MAX_LINKS;
    struct sim_device *dev = &g_sim.hdr->devices[i];
    struct sim_traffic traffic = {0};
    int have_traffic = 0;
    for (int k = 0; k < count; k++) {
        nvmlFieldValue_t *v = &values[k];
        unsigned id = v->fieldId;
        v->timestamp = now_us;
        v->latencyUsec = 0;
        v->value = 0;
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        v->nvmlReturn = NVML_SUCCESS;
        if (!have_traffic && (id == NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION || id == NVML_FI_DEV_PCIE_COUNT_TX_BYTES ||
                              id == NVML_FI_DEV_PCIE_COUNT_RX_BYTES || id == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX ||
                              id == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)) {
            traffic = sim_traffic_now(i);
            have_traffic = 1;
        }
        switch (id) {
        case NVML_FI_DEV_NVLINK_LINK_COUNT:
            v->value = links;
            break;
        case NVML_FI_DEV_MEMORY_TEMP:
            v->value = 34 + (current_util(i) * 3) / 10;
            break;
        case NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
            v->value = (unsigned long long)traffic.energy_mj;
            break;
        case NVML_FI_DEV_PCIE_REPLAY_COUNTER:
            v->value = 0;
            break;
        case NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
        case NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
            v->value = (unsigned long long)(id == NVML_FI_DEV_PCIE_COUNT_TX_BYTES ? traffic.pcie_tx_bytes
                                                                                 : traffic.pcie_rx_bytes);
            break;
        case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
        case NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
            if (pcie) {
                v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
                break;
            }
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
            v->value = (unsigned long long)((id == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX ? traffic.nvlink_tx_bytes
                                                                                        : traffic.nvlink_rx_bytes) /
                                            1024.0);
            break;
        case NVML_FI_DEV_REMAPPED_COR:
            v->value = __atomic_load_n(&dev->remapped_rows_corr, __ATOMIC_RELAXED);
            break;
        case NVML_FI_DEV_REMAPPED_UNC:
            v->value = __atomic_load_n(&dev->remapped_rows_unc, __ATOMIC_RELAXED);
            break;
        case NVML_FI_DEV_REMAPPED_PENDING:
            v->value = __atomic_load_n(&dev->remap_pending, __ATOMIC_RELAXED) ? 1u : 0u;
            break;
        case NVML_FI_DEV_REMAPPED_FAILURE:
            v->value = __atomic_load_n(&dev->remap_failure, __ATOMIC_RELAXED) ? 1u : 0u;
            break;
        default:
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

/* ---- topology ----
 *
 * PCIe (every topology): pairs (0,1), (2,3)... share a PCIe switch (SINGLE); the first
 * half of the devices hangs off host bridges of CPU/NUMA node 0, the second half off
 * CPU 1; two switches of one half sit under different host bridges of that CPU (NODE);
 * across halves the path crosses the CPU interconnect (SYSTEM). This is the layout of an
 * 8-GPU HGX board: 4 PCIe switches with 2 GPUs each, 2 per CPU socket.
 *
 * NVLink (header.topology):
 *   pcie          no NVLink (a PCIe card or a VM): NVLink calls answer NOT_SUPPORTED.
 *   nvlink-pairs  GPUs 2k and 2k+1 are bridged: links 0..SIM_PAIR_LINKS-1 active, remote
 *                 device a GPU (the peer's PCI bus id); other links inactive. An odd last
 *                 GPU has no peer: NVLink supported, no link active.
 *   nvswitch      every link active, each to one of SIM_NVSWITCHES NVSwitches (remote type
 *                 SWITCH, PCI bus 0xC0 + switch; links 0-4, 5-8, 9-12, 13-17 as on HGX H100).
 * Link numbers >= NVML_NVLINK_MAX_LINKS (18 for driver 550) are INVALID_ARGUMENT; the
 * remote end of an inactive link is NOT_SUPPORTED.
 */
#define NVML_TOPOLOGY_INTERNAL 0
#define NVML_TOPOLOGY_SINGLE 10
#define NVML_TOPOLOGY_NODE 40
#define NVML_TOPOLOGY_SYSTEM 50

API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b, unsigned int *level)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, a);
    DEV_OR_RETURN(j, b);
    if (!level)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = g_sim.hdr->device_count, half = (n + 1) / 2;
    if (i == j)
        *level = NVML_TOPOLOGY_INTERNAL;
    else if (i / 2 == j / 2)
        *level = NVML_TOPOLOGY_SINGLE;
    else if (((unsigned)i < half) == ((unsigned)j < half))
        *level = NVML_TOPOLOGY_NODE;
    else
        *level = NVML_TOPOLOGY_SYSTEM;
    return NVML_SUCCESS;
}

#define NVML_NVLINK_DEVICE_TYPE_GPU 0x00
#define NVML_NVLINK_DEVICE_TYPE_SWITCH 0x02
#define NVML_NVLINK_VERSION_4_0 6 /* nvmlNvlinkVersion_t of Hopper's NVLink 4 */
#define NVML_NVLINK_CAP_COUNT 6
#define NVSWITCH_PCI_DEVICE_ID 0x22a310deu /* NVSwitch (LS10) | NVIDIA vendor id */

/* remote end of (device i, link): 0 none (inactive), 1 GPU (*peer), 2 NVSwitch (*peer) */
static int link_remote(int i, unsigned link, unsigned *peer)
{
    switch (g_sim.hdr->topology) {
    case SIM_TOPO_NVLINK_PAIRS: {
        unsigned p = (unsigned)i ^ 1u;
        if (link >= SIM_PAIR_LINKS || p >= g_sim.hdr->device_count)
            return 0;
        *peer = p;
        return 1;
    }
    case SIM_TOPO_NVSWITCH:
        *peer = link < 5 ? 0 : link < 9 ? 1 : link < 13 ? 2 : 3;
        return 2;
    default:
        return 0;
    }
}

/* common checks of the per-link calls: returns the device index or a negative NVML error */
static int check_link(nvmlDevice_t d, unsigned link, const void *out)
{
    int i = check_dev(d);
    if (i < 0)
        return i;
    if (!out || link >= SIM_NVLINK_MAX_LINKS)
        return -NVML_ERROR_INVALID_ARGUMENT;
    if (g_sim.hdr->topology == SIM_TOPO_PCIE)
        return -NVML_ERROR_NOT_SUPPORTED;
    return i;
}

#define LINK_OR_RETURN(var, handle, link, out) \
    int var = check_link(handle, link, out);    \
    if (var < 0)                                \
        return -var

API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, unsigned int *is_active)
{
    NVML_COST(COST_OTHER_NS);
    LINK_OR_RETURN(i, d, link, is_active);
    unsigned peer;
    *is_active = link_remote(i, link, &peer) ? 1u /* NVML_FEATURE_ENABLED */ : 0u;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t d, unsigned int link, unsigned int *version)
{
    NVML_COST(COST_OTHER_NS);
    LINK_OR_RETURN(i, d, link, version);
    (void)i;
    *version = NVML_NVLINK_VERSION_4_0;
    return NVML_SUCCESS;
}

/* capabilities of an H100 SXM link: P2P and P2P atomics over NVLink, no system memory
 * access (that is NVLink-C2C on Grace), no SLI; every link is a valid link */
API nvmlReturn_t nvmlDeviceGetNvLinkCapability(nvmlDevice_t d, unsigned int link, unsigned int capability,
                                               unsigned int *result)
{
    NVML_COST(COST_OTHER_NS);
    LINK_OR_RETURN(i, d, link, result);
    (void)i;
    static const unsigned caps[NVML_NVLINK_CAP_COUNT] = {1, 0, 1, 0, 0, 1};
    if (capability >= NVML_NVLINK_CAP_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    *result = caps[capability];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t d, unsigned int link, unsigned int *type)
{
    NVML_COST(COST_OTHER_NS);
    LINK_OR_RETURN(i, d, link, type);
    unsigned peer;
    int kind = link_remote(i, link, &peer);
    if (!kind)
        return NVML_ERROR_NOT_SUPPORTED;
    *type = kind == 1 ? NVML_NVLINK_DEVICE_TYPE_GPU : NVML_NVLINK_DEVICE_TYPE_SWITCH;
    return NVML_SUCCESS;
}

/* PCI location of the remote end; 0 or a negative NVML error */
static int remote_pci(nvmlDevice_t d, unsigned link, const void *out, unsigned *bus, unsigned *dev_id)
{
    int i = check_link(d, link, out);
    if (i < 0)
        return i;
    unsigned peer;
    int kind = link_remote(i, link, &peer);
    if (!kind)
        return -NVML_ERROR_NOT_SUPPORTED;
    if (kind == 1) {
        *bus = g_sim.hdr->devices[peer].pci_bus;
        *dev_id = 0x233010deu;
    } else {
        *bus = 0xc0u + peer;
        *dev_id = NVSWITCH_PCI_DEVICE_ID;
    }
    return 0;
}

/* pciSubSystemId is not filled in by the real call either ("indeterminate") */
API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t d, unsigned int link, nvmlPciInfo_t *pci)
{
    NVML_COST(COST_OTHER_NS);
    unsigned bus = 0, dev_id = 0;
    int rc = remote_pci(d, link, pci, &bus, &dev_id);
    if (rc < 0)
        return -rc;
    memset(pci, 0, sizeof(*pci));
    pci->bus = bus;
    pci->pciDeviceId = dev_id;
    snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.0", 0u, bus, 0u);
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0", 0u, bus, 0u);
    return NVML_SUCCESS;
}

/* the unversioned entry point fills the old (v1/v2) struct layout */
API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t d, unsigned int link, nvmlPciInfo_v2_t *pci)
{
    NVML_COST(COST_OTHER_NS);
    unsigned bus = 0, dev_id = 0;
    int rc = remote_pci(d, link, pci, &bus, &dev_id);
    if (rc < 0)
        return -rc;
    memset(pci, 0, sizeof(*pci));
    pci->bus = bus;
    pci->pciDeviceId = dev_id;
    snprintf(pci->busId, sizeof(pci->busId), "%04X:%02X:%02X.0", 0u, bus, 0u);
    return NVML_SUCCESS;
}

/* ---- row remapping ---- */

API nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr_rows, unsigned int *unc_rows,
                                           unsigned int *is_pending, unsigned int *failure_occurred)
{
    NVML_COST(COST_ECC_NS);
    DEV_OR_RETURN(i, d);
    if (!corr_rows || !unc_rows || !is_pending || !failure_occurred)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct sim_device *dev = &g_sim.hdr->devices[i];
    *corr_rows = __atomic_load_n(&dev->remapped_rows_corr, __ATOMIC_RELAXED);
    *unc_rows = __atomic_load_n(&dev->remapped_rows_unc, __ATOMIC_RELAXED);
    *is_pending = __atomic_load_n(&dev->remap_pending, __ATOMIC_RELAXED) ? 1u : 0u;
    *failure_occurred = __atomic_load_n(&dev->remap_failure, __ATOMIC_RELAXED) ? 1u : 0u;
    return NVML_SUCCESS;
}

/* ---- ECC ---- */

API nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending)
{
    NVML_COST(COST_OTHER_NS);
    DEV_OR_RETURN(i, d);
    (void)i;
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = 1;
    return NVML_SUCCESS;
}

/* errorType: 0 corrected, 1 uncorrected; counterType: 0 volatile, 1 aggregate */
API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, unsigned int error_type, unsigned int counter_type,
                                             unsigned long long *count)
{
    NVML_COST(COST_ECC_NS);
    DEV_OR_RETURN(i, d);
    if (!count || error_type > 1 || counter_type > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct sim_device *dev = &g_sim.hdr->devices[i];
    if (counter_type == 0)
        *count = error_type ? dev->ecc_uncorrected_volatile : dev->ecc_corrected_volatile;
    else
        *count = error_type ? dev->ecc_uncorrected_aggregate : dev->ecc_corrected_aggregate;
    return NVML_SUCCESS;
}

/* ---- events ---- */

#define SUPPORTED_EVENTS (SIM_EVENT_SINGLE_BIT_ECC | SIM_EVENT_DOUBLE_BIT_ECC | SIM_EVENT_XID)

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types)
{
    NVML_COST(COST_OTHER_NS);
    int i = dev_index(d);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !types)
        return NVML_ERROR_INVALID_ARGUMENT;
    *types = SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct nvml_event_set *s = calloc(1, sizeof(*s));
    if (!s)
        return NVML_ERROR_UNKNOWN;
    s->last_seq = __atomic_load_n(&g_sim.hdr->event_seq, __ATOMIC_ACQUIRE);
    *set = s;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set)
{
    NVML_COST(COST_OTHER_NS);
    int i = dev_index(d);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !set)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~SUPPORTED_EVENTS)
        return NVML_ERROR_NOT_SUPPORTED;
    set->types[i] |= types;
    return NVML_SUCCESS;
}

static nvmlReturn_t wait_event(nvmlEventSet_t set, nvmlDevice_t *dev, unsigned long long *type,
                               unsigned long long *data, unsigned int timeout_ms)
{
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = sim_realtime_ns() + (uint64_t)timeout_ms * 1000000ULL;
    for (;;) {
        uint64_t head = __atomic_load_n(&g_sim.hdr->event_seq, __ATOMIC_ACQUIRE);
        if (head > set->last_seq + SIM_MAX_EVENTS)
            set->last_seq = head - SIM_MAX_EVENTS; /* overrun: the oldest are gone */
        while (set->last_seq < head) {
            uint64_t seq = ++set->last_seq;
            struct sim_event ev = g_sim.hdr->events[(seq - 1) % SIM_MAX_EVENTS];
            if (ev.seq != seq || ev.device >= SIM_MAX_DEVICES)
                continue;
            if (!(set->types[ev.device] & ev.type))
                continue;
            *dev = &g_devices[ev.device];
            *type = ev.type;
            *data = ev.data;
            return NVML_SUCCESS;
        }
        uint64_t now = sim_realtime_ns();
        if (now >= deadline)
            return NVML_ERROR_TIMEOUT;
        uint64_t left = deadline - now;
        struct timespec ts = {0, (long)(left < 5000000ULL ? left : 5000000ULL)};
        nanosleep(&ts, NULL);
    }
}

API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    NVML_COST(COST_OTHER_NS);
    if (!data)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(data, 0, sizeof(*data));
    nvmlReturn_t rc = wait_event(set, &data->device, &data->eventType, &data->eventData, timeout_ms);
    data->gpuInstanceId = data->computeInstanceId = 0xffffffffu;
    return rc;
}

API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_v1_t *data, unsigned int timeout_ms)
{
    NVML_COST(COST_OTHER_NS);
    if (!data)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(data, 0, sizeof(*data));
    return wait_event(set, &data->device, &data->eventType, &data->eventData, timeout_ms);
}

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    NVML_COST(COST_OTHER_NS);
    if (!g_init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    free(set);
    return NVML_SUCCESS;
}

/* ==== gpuwatchsim_* helpers for the Python side (not NVML) ==== */

/* Create (or replace) a node's state file. Returns 0 or -errno. */
API int gpuwatchsim_create(const char *path, const char *node_name, const char *root, unsigned device_count,
                           const char *model, unsigned long long memory_bytes, unsigned rm_alloc_params,
                           unsigned rm_device_handles, unsigned topology, unsigned engine_lanes,
                           unsigned timeslice_us)
{
    if (!path || !node_name || !root || !model || device_count == 0 || device_count > SIM_MAX_DEVICES ||
        topology > SIM_TOPO_NVSWITCH || engine_lanes < 1 || engine_lanes > SIM_MAX_LANES || timeslice_us == 0)
        return -EINVAL;
    char tmp[SIM_PATH_LEN + 16];
    snprintf(tmp, sizeof(tmp), "%s.tmp%d", path, (int)getpid());
    int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0)
        return -errno;
    fchmod(fd, 0666);
    if (ftruncate(fd, (off_t)sizeof(struct sim_header)) < 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        return -e;
    }
    struct sim_header *h = mmap(NULL, sizeof(*h), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) {
        int e = errno;
        close(fd);
        unlink(tmp);
        return -e;
    }
    h->layout_version = SIM_LAYOUT_VERSION;
    h->device_count = device_count;
    h->created_us = sim_realtime_ns() / 1000ULL;
    snprintf(h->node_name, sizeof(h->node_name), "%s", node_name);
    snprintf(h->root, sizeof(h->root), "%s", root);
    snprintf(h->driver_version, sizeof(h->driver_version), "550.54.15");
    h->cuda_driver_version = 12040;
    h->rm_alloc_params = rm_alloc_params;
    h->rm_device_handles = rm_device_handles ? 1u : 0u;
    h->topology = topology;
    h->sample_period_ns = SIM_DEFAULT_SAMPLE_PERIOD_NS;
    h->nvml_cost = SIM_NVML_COST_OFF;
    h->kernel_host = SIM_KERNEL_HOST_SPIN;
    /* stable, obviously-fake identities derived from the node name */
    uint32_t seed = 2166136261u;
    for (const char *c = node_name; *c; c++)
        seed = (seed ^ (uint8_t)*c) * 16777619u;
    for (unsigned i = 0; i < device_count; i++) {
        struct sim_device *d = &h->devices[i];
        snprintf(d->name, sizeof(d->name), "gpuwatch-sim %s", model);
        snprintf(d->uuid, sizeof(d->uuid), "GPU-5157%04x-%04x-4000-8000-%012x", seed & 0xffffu, i,
                 (unsigned)(seed ^ (i * 2654435761u)));
        snprintf(d->serial, sizeof(d->serial), "SIM%08X%02u", seed, i);
        d->pci_bus = 0x18 + 0x10 * i;
        snprintf(d->pci_bus_id, sizeof(d->pci_bus_id), "00000000:%02X:00.0", d->pci_bus);
        d->memory_total_bytes = memory_bytes;
        d->minor = i;
        /* RM numbers device instances in its own order: reversed here, so instance !=
         * minor on every node with more than one GPU (cuda.c "driver model") */
        d->device_instance = device_count - 1 - i;
        d->gpu_id = d->pci_bus << 8;
        d->power_limit_mw = 700000;
        d->cc_major = 9;
        d->cc_minor = 0;
        d->sm_clock_max_mhz = 1980;
        d->mem_clock_max_mhz = 2619;
        h->engines[i].lanes = engine_lanes;
        h->engines[i].timeslice_us = timeslice_us;
    }
    __atomic_store_n(&h->magic, SIM_MAGIC, __ATOMIC_RELEASE);
    msync(h, sizeof(*h), MS_SYNC);
    munmap(h, sizeof(*h));
    close(fd);
    if (rename(tmp, path) < 0) {
        int e = errno;
        unlink(tmp);
        return -e;
    }
    return 0;
}

/* Settings of a node that is up (gpuwatch/sim/node.py up): the NVML sample period (ns,
 * 0: keep) and the cost model (SIM_NVML_COST_*). Returns 0 or -errno. */
static int helper_open(const char *path, struct sim_handle *h);
API int gpuwatchsim_configure(const char *path, unsigned long long sample_period_ns, unsigned nvml_cost)
{
    if (!path || nvml_cost > SIM_NVML_COST_H100_580 ||
        (sample_period_ns && (sample_period_ns < SIM_MIN_SAMPLE_PERIOD_NS || sample_period_ns > SIM_MAX_SAMPLE_PERIOD_NS)))
        return -EINVAL;
    struct sim_handle h;
    int rc = helper_open(path, &h);
    if (rc < 0)
        return rc;
    if (sample_period_ns)
        __atomic_store_n(&h.hdr->sample_period_ns, (uint64_t)sample_period_ns, __ATOMIC_RELEASE);
    __atomic_store_n(&h.hdr->nvml_cost, nvml_cost, __ATOMIC_RELEASE);
    return 0;
}

/* What a running kernel does to its host thread on a node that is up (SIM_KERNEL_HOST_*):
 * set it when `kernel_host` is one, then return the node's (or -errno). */
API int gpuwatchsim_kernel_host(const char *path, int kernel_host)
{
    if (!path || kernel_host > (int)SIM_KERNEL_HOST_SLEEP)
        return -EINVAL;
    struct sim_handle h;
    int rc = helper_open(path, &h);
    if (rc < 0)
        return rc;
    if (kernel_host >= 0)
        __atomic_store_n(&h.hdr->kernel_host, (uint32_t)kernel_host, __ATOMIC_RELEASE);
    return (int)__atomic_load_n(&h.hdr->kernel_host, __ATOMIC_ACQUIRE);
}

/* The node's NVML sample period (ns) and cost model. Returns 0 or -errno. */
API int gpuwatchsim_settings(const char *path, unsigned long long *sample_period_ns, unsigned *nvml_cost)
{
    if (!path || !sample_period_ns || !nvml_cost)
        return -EINVAL;
    struct sim_handle h;
    int rc = helper_open(path, &h);
    if (rc < 0)
        return rc;
    *sample_period_ns = sim_sample_period_ns(h.hdr);
    *nvml_cost = __atomic_load_n(&h.hdr->nvml_cost, __ATOMIC_ACQUIRE);
    return 0;
}

/* Start (replay_path non-empty) or stop (empty) an NVML replay: the compiled recording at
 * replay_path, its start shifted to origin_us (CLOCK_REALTIME). Returns 0 or -errno. */
API int gpuwatchsim_replay(const char *path, const char *replay_path, unsigned long long origin_us)
{
    if (!path || !replay_path || strlen(replay_path) >= SIM_PATH_LEN)
        return -EINVAL;
    struct sim_handle h;
    int rc = helper_open(path, &h);
    if (rc < 0)
        return rc;
    flock(h.fd, LOCK_EX);
    h.hdr->replay_path[0] = 0; /* readers see no replay while the path is rewritten */
    __atomic_store_n(&h.hdr->replay_origin_us, (uint64_t)origin_us, __ATOMIC_RELEASE);
    if (replay_path[0]) {
        memcpy(h.hdr->replay_path + 1, replay_path + 1, strlen(replay_path));
        __atomic_store_n(&h.hdr->replay_path[0], replay_path[0], __ATOMIC_RELEASE);
    }
    flock(h.fd, LOCK_UN);
    return 0;
}

/* Python-side access. Handles are cached per path and never closed while the file
 * is the same inode: closing a descriptor of the state file would drop the liveness
 * locks this process may hold through libcuda (classic record-lock semantics). */
#define HELPER_CACHE 16
static struct {
    char path[SIM_PATH_LEN];
    struct sim_handle h;
    int used;
} g_helper_cache[HELPER_CACHE];
static pthread_mutex_t g_helper_lock = PTHREAD_MUTEX_INITIALIZER;

static int helper_open(const char *path, struct sim_handle *h)
{
    pthread_mutex_lock(&g_helper_lock);
    int free_slot = -1;
    for (int i = 0; i < HELPER_CACHE; i++) {
        if (!g_helper_cache[i].used) {
            if (free_slot < 0)
                free_slot = i;
            continue;
        }
        if (strcmp(g_helper_cache[i].path, path) != 0)
            continue;
        if (!sim_is_current(path, &g_helper_cache[i].h)) {
            /* re-created node: the old inode is gone for everyone, drop our handle */
            munmap(g_helper_cache[i].h.hdr, sizeof(struct sim_header));
            close(g_helper_cache[i].h.fd);
            g_helper_cache[i].used = 0;
            if (free_slot < 0)
                free_slot = i;
            continue;
        }
        *h = g_helper_cache[i].h;
        pthread_mutex_unlock(&g_helper_lock);
        return 0;
    }
    int rc = sim_open(path, h);
    if (rc == 0 && free_slot < 0) {
        /* full: evict the oldest entry (another path, so another file) */
        static int next_victim;
        free_slot = next_victim;
        next_victim = (next_victim + 1) % HELPER_CACHE;
        munmap(g_helper_cache[free_slot].h.hdr, sizeof(struct sim_header));
        close(g_helper_cache[free_slot].h.fd);
        g_helper_cache[free_slot].used = 0;
    }
    if (rc == 0 && strlen(path) < SIM_PATH_LEN) {
        snprintf(g_helper_cache[free_slot].path, SIM_PATH_LEN, "%s", path);
        g_helper_cache[free_slot].h = *h;
        g_helper_cache[free_slot].used = 1;
    }
    pthread_mutex_unlock(&g_helper_lock);
    return rc;
}

static void helper_close(struct sim_handle *h)
{
    (void)h; /* cached; see helper_open */
}

/* ---- kernel log: <sim root>/kmsg ----
 *
 * What the real driver prints for an Xid (src/nvidia/src/kernel/gpu/rc/kernel_rc.c):
 *   NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, <message>
 * with pid='<unknown>' and name=<unknown> when no channel/process is known. It goes
 * through printk without a level, so /dev/kmsg shows it at the default level 4
 * (warning). Records use the /dev/kmsg format "<prio>,<seq>,<usec>,-;<message>\n"
 * (usec on CLOCK_MONOTONIC, seq per node), each appended with one write(O_APPEND) so
 * a concurrent reader never sees half a record. */

static const char *xid_description(unsigned code)
{
    switch (code) {
    case 13: return "Graphics Engine Exception";
    case 31: return "GPU memory page fault";
    case 43: return "GPU stopped processing";
    case 45: return "Preemptive cleanup, due to previous errors";
    case 48: return "An uncorrectable double bit error (DBE) has been detected on GPU";
    case 63: return "ECC page retirement or row remapping recording event";
    case 64: return "ECC page retirement or row remapper recording failure";
    case 68: return "Video processor exception";
    case 74: return "NVLink Error";
    case 79: return "GPU has fallen off the bus.";
    case 92: return "High single-bit ECC error rate";
    case 94: return "Contained ECC error";
    case 95: return "Uncontained ECC error";
    case 109: return "Context Switch Timeout Error";
    case 119: return "Timeout waiting for RPC from GSP";
    case 120: return "GSP Error";
    default: return "Error";
    }
}

/* append src to dst[*n..cap) escaping as the kernel's /dev/kmsg does (\xNN for control
 * bytes, bytes >= 0x7f and the backslash) */
static void kmsg_escape(char *dst, size_t *n, size_t cap, const char *src)
{
    for (const unsigned char *c = (const unsigned char *)src; *c && *n + 5 < cap; c++) {
        if (*c < 0x20 || *c >= 0x7f || *c == '\\')
            *n += (size_t)snprintf(dst + *n, cap - *n, "\\x%02x", *c);
        else
            dst[(*n)++] = (char)*c;
    }
    dst[*n] = 0;
}

/* comm of a process as seen from here; 0 or -1 when it cannot be read */
static int read_comm(int pid, char *out, size_t cap)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/comm", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, out, cap - 1);
    close(fd);
    if (n <= 0)
        return -1;
    out[n] = 0;
    if (out[n - 1] == '\n')
        out[n - 1] = 0;
    return 0;
}

/* Append one Xid record to <root>/kmsg. Call with the state file locked exclusively
 * (and g_inject_lock held) so the record order matches the sequence numbers. */
static int kmsg_xid(struct sim_handle *h, unsigned device, unsigned code, int pid)
{
    struct sim_device *d = &h->hdr->devices[device];
    char pid_text[16] = "'<unknown>'", name[64] = "<unknown>";
    if (pid > 0) {
        snprintf(pid_text, sizeof(pid_text), "%d", pid);
        char comm[64];
        if (read_comm(pid, comm, sizeof(comm)) == 0) {
            size_t n = 0;
            kmsg_escape(name, &n, sizeof(name), comm);
        }
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t usec = (uint64_t)ts.tv_sec * 1000000ULL + (uint64_t)ts.tv_nsec / 1000ULL;
    uint64_t seq = h->hdr->kmsg_seq++;
    char line[512];
    int len = snprintf(line, sizeof(line), "4,%llu,%llu,-;NVRM: Xid (PCI:%04x:%02x:%02x): %u, pid=%s, name=%s, %s\n",
                       (unsigned long long)seq, (unsigned long long)usec, 0u, d->pci_bus, 0u, code, pid_text,
                       name, xid_description(code));
    if (len <= 0 || (size_t)len >= sizeof(line))
        return -EOVERFLOW;
    char path[SIM_PATH_LEN + 8];
    snprintf(path, sizeof(path), "%s/kmsg", h->hdr->root);
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return -errno;
    ssize_t w = write(fd, line, (size_t)len);
    int err = w < 0 ? errno : 0;
    close(fd);
    if (w < 0)
        return -err;
    return w == len ? 0 : -EIO;
}

static pthread_mutex_t g_inject_lock = PTHREAD_MUTEX_INITIALIZER;

/* kinds: 0 xid (data = xid), 1 lost, 2 ecc (data = count; uncorrected when flag), 3 clear,
 * 4 row remap failure, 5 lost without a kernel-log record (node teardown). Xids (kinds 0
 * and 1) are delivered as NVML events and logged to <root>/kmsg naming `pid` (<= 0:
 * unknown). Returns 0, -errno when nothing was injected, or +errno when the fault was
 * injected but its kernel-log record could not be written. */
API int gpuwatchsim_inject(const char *path, unsigned device, unsigned kind, unsigned long long data,
                           unsigned uncorrected, int pid)
{
    struct sim_handle h;
    int rc = helper_open(path, &h);
    if (rc < 0)
        return rc;
    if (device >= h.hdr->device_count) {
        helper_close(&h);
        return -ENODEV;
    }
    struct sim_device *d = &h.hdr->devices[device];
    uint64_t type = 0;
    pthread_mutex_lock(&g_inject_lock);
    flock(h.fd, LOCK_EX);
    switch (kind) {
    case 0:
        type = SIM_EVENT_XID;
        break;
    case 1:
    case 5:
        __atomic_store_n(&d->lost, 1, __ATOMIC_RELEASE);
        type = SIM_EVENT_XID;
        data = 79; /* "GPU has fallen off the bus" */
        break;
    case 2:
        if (uncorrected) {
            d->ecc_uncorrected_volatile += data;
            d->ecc_uncorrected_aggregate += data;
            /* Ampere and later remap the row of an uncorrectable error at the next reset */
            __atomic_store_n(&d->remapped_rows_unc, d->remapped_rows_unc + (uint32_t)data, __ATOMIC_RELAXED);
            __atomic_store_n(&d->remap_pending, 1, __ATOMIC_RELAXED);
            type = SIM_EVENT_DOUBLE_BIT_ECC;
        } else {
            d->ecc_corrected_volatile += data;
            d->ecc_corrected_aggregate += data;
            type = SIM_EVENT_SINGLE_BIT_ECC;
        }
        break;
    case 3: /* a GPU reset: back on the bus, volatile counts and pending remaps settled */
        __atomic_store_n(&d->lost, 0, __ATOMIC_RELEASE);
        d->ecc_corrected_volatile = d->ecc_uncorrected_volatile = 0;
        __atomic_store_n(&d->remap_pending, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&d->remap_failure, 0, __ATOMIC_RELAXED);
        break;
    case 4:
        __atomic_store_n(&d->remap_failure, 1, __ATOMIC_RELAXED);
        break;
    default:
        flock(h.fd, LOCK_UN);
        pthread_mutex_unlock(&g_inject_lock);
        helper_close(&h);
        return -EINVAL;
    }
    if (type) {
        uint64_t seq = h.hdr->event_seq + 1;
        struct sim_event *ev = &h.hdr->events[(seq - 1) % SIM_MAX_EVENTS];
        ev->seq = seq;
        ev->type = type;
        ev->data = data;
        ev->device = device;
        ev->time_us = sim_realtime_ns() / 1000ULL;
        __atomic_store_n(&h.hdr->event_seq, seq, __ATOMIC_RELEASE);
    }
    int log_rc = type == SIM_EVENT_XID && kind != 5 ? -kmsg_xid(&h, device, (unsigned)data, pid) : 0;
    flock(h.fd, LOCK_UN);
    pthread_mutex_unlock(&g_inject_lock);
    helper_close(&h);
    return log_rc;
}

struct gpuwatchsim_proc_info {
    int32_t host_pid;      /* pid in the caller's namespace (0 = alive but not visible) */
    int32_t ns_pid;        /* pid inside the process's own namespace */
    uint64_t pidns_ino;
    uint64_t start_ticks;
    uint32_t device;
    uint32_t pad;
    uint64_t memory_bytes;
    uint64_t allocations;
    uint64_t busy_ns_total;
    uint64_t launches;
    uint64_t engine_wait_ns_total;
    uint64_t rm_memory_bytes;
    uint64_t rm_objects;
    uint64_t context_bytes;
    uint64_t managed_bytes;
    uint64_t requested_bytes;
};

/* List live (process, device) pairs with a context or memory. Returns the number of
 * entries written (<= cap) or -errno. */
API int gpuwatchsim_list(const char *path, struct gpuwatchsim_proc_info *out, unsigned cap)
{
    struct sim_handle h;
    int rc = helper_open(path, &h);
    if (rc < 0)
        return rc;
    struct sim_self self;
    sim_self_identity(&self);
    unsigned n = 0;
    struct sim_live *live = malloc(sizeof(*live));
    if (!live)
        return -ENOMEM;
    flock(h.fd, LOCK_SH);
    sim_liveness(&h, &self, live);
    for (uint32_t s = 0; s < live->count; s++) {
        struct sim_proc *p = &h.hdr->procs[s];
        if (!p->in_use)
            continue;
        int pid = live->pid[s];
        if (pid < 0)
            continue;
        for (uint32_t dv = 0; dv < h.hdr->device_count && n < cap; dv++) {
            if (!((p->context_mask >> dv) & 1u) && p->memory_bytes[dv] == 0)
                continue;
            struct gpuwatchsim_proc_info *o = &out[n++];
            memset(o, 0, sizeof(*o));
            o->host_pid = pid;
            o->ns_pid = p->ns_pid;
            o->pidns_ino = p->pidns_ino;
            o->start_ticks = p->start_ticks;
            o->device = dv;
            o->memory_bytes = p->memory_bytes[dv];
            o->allocations = p->allocations[dv];
            o->busy_ns_total = __atomic_load_n(&p->busy_ns_total[dv], __ATOMIC_RELAXED);
            o->launches = __atomic_load_n(&p->launches[dv], __ATOMIC_RELAXED);
            o->engine_wait_ns_total = __atomic_load_n(&p->engine_wait_ns_total[dv], __ATOMIC_RELAXED);
            o->rm_memory_bytes = p->rm_memory_bytes[dv];
            o->rm_objects = p->rm_objects[dv];
            o->context_bytes = p->context_bytes[dv];
            o->managed_bytes = p->managed_bytes[dv];
            o->requested_bytes = p->requested_bytes[dv];
        }
    }
    flock(h.fd, LOCK_UN);
    free(live);
    helper_close(&h);
    return (int)n;
}

struct gpuwatchsim_device_info {
    char name[SIM_NAME_LEN];
    char uuid[48];
    char pci_bus_id[32];
    uint64_t memory_total_bytes;
    uint64_t ecc_corrected_volatile;
    uint64_t ecc_uncorrected_volatile;
    uint32_t minor;
    uint32_t lost;
    uint32_t utilization_percent; /* over the last second, as nvmlDeviceGetUtilizationRates */
    uint32_t remap_failure;
    uint32_t remapped_rows_unc;
    uint32_t remap_pending;
    uint32_t device_instance;
    uint32_t gpu_id;
};

/* Static facts, utilisation and fault state of one device. Returns 0 or -errno. */
API int gpuwatchsim_device(const char *path, unsigned device, struct gpuwatchsim_device_info *out)
{
    struct sim_handle h;
    int rc = helper_open(path, &h);
    if (rc < 0)
        return rc;
    if (device >= h.hdr->device_count) {
        helper_close(&h);
        return -ENODEV;
    }
    struct sim_device *d = &h.hdr->devices[device];
    memset(out, 0, sizeof(*out));
    memcpy(out->name, d->name, sizeof(out->name));
    memcpy(out->uuid, d->uuid, sizeof(out->uuid));
    memcpy(out->pci_bus_id, d->pci_bus_id, sizeof(out->pci_bus_id));
    out->memory_total_bytes = d->memory_total_bytes;
    out->ecc_corrected_volatile = d->ecc_corrected_volatile;
    out->ecc_uncorrected_volatile = d->ecc_uncorrected_volatile;
    out->minor = d->minor;
    out->lost = d->lost;
    out->remap_failure = d->remap_failure;
    out->remapped_rows_unc = d->remapped_rows_unc;
    out->remap_pending = d->remap_pending;
    out->device_instance = d->device_instance;
    out->gpu_id = d->gpu_id;
    uint64_t now = sim_realtime_ns();
    flock(h.fd, LOCK_SH);
    out->utilization_percent = util_pct_of(&h, (int)device, now - UTIL_WINDOW_NS, now);
    flock(h.fd, LOCK_UN);
    helper_close(&h);
    return 0;
}

/* Device count, sim root and topology (SIM_TOPO_*) recorded in a state file. Returns
 * the count or -errno. */
API int gpuwatchsim_node(const char *path, char *root, unsigned root_len, unsigned *topology)
{
    struct sim_handle h;
    int rc = helper_open(path, &h);
    if (rc < 0)
        return rc;
    int n = (int)h.hdr->device_count;
    if (root && root_len)
        snprintf(root, root_len, "%s", h.hdr->root);
    if (topology)
        *topology = h.hdr->topology;
    helper_close(&h);
    return n;
}

struct gpuwatchsim_engine_info {
    uint32_t lanes;
    uint32_t timeslice_us;
    uint64_t acquisitions;
    uint64_t steals;
    uint64_t yields;
    uint32_t holders;                     /* lanes held now by a running holder */
    uint32_t waiters;                     /* live waiters now */
    int32_t holder_pids[SIM_MAX_LANES];   /* per lane: running holder's pid here (0 unknown), -1 none */
};

/* The execution engine of one device: mode, counters and who holds it now. A lane whose
 * holder stopped renewing it (frozen, stopped, dead) counts as free. Returns 0 or -errno. */
API int gpuwatchsim_engine(const char *path, unsigned device, struct gpuwatchsim_engine_info *out)
{
    struct sim_handle h;
    int rc = helper_open(path, &h);
    if (rc < 0)
        return rc;
    if (device >= h.hdr->device_count) {
        helper_close(&h);
        return -ENODEV;
    }
    struct sim_engine *e = &h.hdr->engines[device];
    memset(out, 0, sizeof(*out));
    out->lanes = e->lanes;
    out->timeslice_us = e->timeslice_us;
    out->acquisitions = __atomic_load_n(&e->acquisitions, __ATOMIC_RELAXED);
    out->steals = __atomic_load_n(&e->steals, __ATOMIC_RELAXED);
    out->yields = __atomic_load_n(&e->yields, __ATOMIC_RELAXED);
    struct sim_self self;
    sim_self_identity(&self);
    uint64_t now = sim_monotonic_ns();
    for (unsigned l = 0; l < SIM_MAX_LANES; l++) {
        out->holder_pids[l] = -1;
        if (l >= e->lanes)
            continue;
        uint64_t w = __atomic_load_n(&e->lane[l], __ATOMIC_SEQ_CST);
        if (sim_engine_word_stale(w, now / 1000ULL, sim_engine_stale_us(h.hdr)))
            continue;
        int slot = sim_engine_word_slot(w);
        int pid = slot >= 0 && slot < SIM_MAX_PROCS ? sim_slot_owner(&h, slot, &self) : -1;
        out->holder_pids[l] = pid < 0 ? 0 : pid;
        out->holders++;
    }
    uint32_t hw = h.hdr->proc_high_water;
    for (uint32_t s = 0; s < hw && s < SIM_MAX_PROCS; s++) {
        uint64_t t = __atomic_load_n(&e->wait_ticket[s], __ATOMIC_SEQ_CST);
        uint64_t seen = __atomic_load_n(&e->wait_seen_ns[s], __ATOMIC_SEQ_CST);
        if (t && !(now > seen && now - seen > SIM_WAITER_STALE_NS))
            out->waiters++;
    }
    helper_close(&h);
    return 0;
}

/* Size of the state header, so Python can check it built against the same layout. */
API unsigned long long gpuwatchsim_state_bytes(void)
{
    return sizeof(struct sim_header);
}
