/*
 * gpuwatch-sim stub CUDA driver: libcuda.so.1 for a simulated GPU node.
 *
 * What it does, so that everything above it can be tested for real without a GPU:
 *   - devices come from the node's state file (GPUWATCH_SIM_STATE); CUDA_VISIBLE_DEVICES
 *     (indices or UUIDs) selects and reorders them as the real driver does;
 *   - allocations charge the shared per-device ledger and fail with
 *     CUDA_ERROR_OUT_OF_MEMORY (2) when the simulated device is full; memory of dead
 *     processes is reclaimed (see simstate.h: liveness locks);
 *   - it issues the driver traffic the real NVIDIA driver sees (see "driver model" below
 *     and ../README.md "Driver traffic"): CARD_INFO at cuInit, the RM client, device,
 *     subdevice, VA space and context memory at context creation, memory objects through
 *     RM_ALLOC or VID_HEAP_CONTROL (one per cuMemAlloc or carved from chunks), stream-
 *     ordered pools (cuMemAllocAsync, cuMemPool*) and VMM (cuMemCreate/Map/Release),
 *     managed memory through nvidia-uvm, frees by handle, by parent and by closing
 *     nvidiactl. The nodes are /dev/null (nvidiactl, nvidia<N>) and /dev/zero
 *     (nvidia-uvm), so the ioctls reach the kernel and fail harmlessly with ENOTTY; the
 *     stub writes the driver's answer into the parameters before the syscall;
 *   - BY DEFAULT IT SPEAKS LIKE REAL CUDA, as recorded on an H100 (driver 580.159.04,
 *     CUDA 13.0; tests/fixtures/traces/real/, ../../shared/real-gpu/README.md section 1,
 *     compared checkpoint by checkpoint in tests/system/test_sim_real_shape.py):
 *       every RM_ALLOC is NVOS64 with paramsSize 0 (RM sizes the parameters by class);
 *       a context allocates 518 MiB of class-0x40 objects (NVML per-process after the
 *         first context, and after a second one), as the recorded context's 17 objects:
 *         6 MiB, fourteen of 2 MiB, 70 MiB and 414 MiB (each size is the nvidia-uvm
 *         external range created right after its RM_ALLOC; they add up to NVML's 518);
 *       a cuMemAlloc below 2 MiB is carved from a 2 MiB object (1 KiB then 1 MiB: one
 *         RM_ALLOC, NVML +2 MiB), 2 MiB and above get an object each;
 *       managed memory is nvidia-uvm only and NVML's per-process number leaves it out;
 *       pools: the first pool allocation of a process on a GPU adds a class-0x3E object,
 *         pool memory comes in 32 MiB class-0x40 objects kept until the pool is trimmed
 *         (a synchronize trims to the release threshold, 0), destroyed or the device goes;
 *       cuMemCreate allocates its class-0x40 object at creation (mapping is UVM's).
 *     What the sim does not issue: the context's other objects (channels, copy engines,
 *     system memory, 97 RM_ALLOCs on a real H100), RM_CONTROLs and the UVM range traffic.
 *   - kernel launches burn CPU for the duration the caller asks for and credit the
 *     thread's runnable time (CPU time + run-queue wait) as busy time of (process,
 *     device). A frozen or stopped process is not runnable, so it accrues no busy time.
 *   - kernels on one device contend for its execution engine (simstate.h): a kernel
 *     runs only while its thread holds the engine, time-sliced with the other tenants
 *     (or up to `lanes` at once in the MPS-like mode); waiting is sleeping, not busy.
 *
 * How a caller asks for kernel duration (the stub's one convention):
 *   cuLaunchKernel / cuLaunchKernelEx: kernelParams[0] points to a uint64_t number of
 *     microseconds of work (NULL kernelParams = an empty kernel);
 *   cuGraphLaunch: the CUgraphExec handle value itself is the number of microseconds
 *     (the stub has no graph construction API).
 *   The work is runnable time (see run_kernel), so host CPU contention does not stretch
 *     kernels, but freezing or stopping the caller pauses them.
 * Device pointers are fake addresses (managed ones are real mappings of nvidia-uvm) and
 * must never be dereferenced.
 *
 * Per-process configuration (environment, read at cuInit; `gpuwatch sim run` sets it):
 *   GPUWATCH_SIM_ALLOC_PATH     rm-alloc (default) | vid-heap
 *   GPUWATCH_SIM_SUBALLOC_MIB   2 (default, as real CUDA): cuMemAllocs below N MiB are
 *                               carved from N-MiB chunks; 0: one driver allocation per
 *                               cuMemAlloc
 *   GPUWATCH_SIM_CONTEXT_MIB    memory a context allocates for itself (default 518, the
 *                               H100's; 0: none)
 *   GPUWATCH_SIM_RM_PARAMS_SIZE zero (default, as real libcuda 580): RM_ALLOC paramsSize 0;
 *                               class: sizeof the class's parameters (older stub, NVOS21)
 *   GPUWATCH_SIM_CTX_TEARDOWN   how the last cuCtxDestroy of a process ends its client:
 *                               free-device (default) | free-client | close-fd
 * An invalid value makes cuInit fail with CUDA_ERROR_INVALID_VALUE (and a line on stderr).
 */
#define _GNU_SOURCE
#include "simstate.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct sim_ctx *CUcontext;
typedef void *CUstream;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUgraphExec;
typedef struct { char bytes[16]; } CUuuid;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_ECC_UNCORRECTABLE = 214,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

/* ---- NVIDIA driver ABI (open-gpu-kernel-modules; ../../shared/nvidia-abi.md) ---- */
#define NV_IOCTL_MAGIC 'F'
#define NV_ESC_RM_FREE 0x29
#define NV_ESC_RM_CONTROL 0x2A
#define NV_ESC_RM_ALLOC 0x2B
#define NV_ESC_RM_VID_HEAP_CONTROL 0x4A
#define NV_ESC_CARD_INFO 200
#define NV01_MEMORY_LOCAL_USER 0x40
#define NV01_ROOT_CLIENT 0x41
#define NV01_DEVICE_0 0x80
#define NV20_SUBDEVICE_0 0x2080
#define FERMI_VASPACE_A 0x90F1
#define NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 0x205
#define NVOS32_FUNCTION_ALLOC_SIZE 2
#define NVOS32_FUNCTION_FREE 3
#define NVOS32_TYPE_IMAGE 0
#define NVOS32_ATTR_LOCATION_VIDMEM 0u /* attr bits 26:25 */
#define NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED 0x4000u
#define NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED 0x1u
#define NV_OK 0u
#define NV_ERR_NO_MEMORY 0x51u
#define NV_MAX_CARDS 32
#define UVM_INITIALIZE 0x30000001UL /* nvidia-uvm ioctls are bare numbers */

typedef struct {
    uint8_t valid;          /* 0 */
    uint8_t pad0[3];
    uint32_t domain;        /* 4: nv_pci_info_t */
    uint8_t bus, slot, function, pad1;
    uint16_t vendor_id, device_id;
    uint32_t gpu_id;        /* 16 */
    uint16_t interrupt_line;/* 20 */
    uint16_t pad2;
    uint64_t reg_address;   /* 24 */
    uint64_t reg_size;      /* 32 */
    uint64_t fb_address;    /* 40 */
    uint64_t fb_size;       /* 48 */
    uint32_t minor_number;  /* 56 */
    uint8_t dev_name[10];   /* 60 */
    uint8_t pad3[2];
} nv_ioctl_card_info_t; /* 72 B */

typedef struct {
    uint32_t hClient, hObject, cmd, flags;
    uint64_t params;
    uint32_t paramsSize, status;
} NVOS54_PARAMETERS; /* 32 B */

typedef struct {
    uint32_t gpuId;            /* 0 */
    uint32_t gpuFlags;         /* 4 */
    uint32_t deviceInstance;   /* 8 */
    uint32_t subDeviceInstance;/* 12 */
    uint32_t sliStatus;        /* 16 */
    uint32_t boardId;          /* 20 */
    uint32_t gpuInstance;      /* 24 */
    int32_t numaId;            /* 28 */
} NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS; /* 32 B */

typedef struct {
    uint32_t deviceId;      /* 0 */
    uint32_t hClientShare;  /* 4 */
    uint32_t hTargetClient; /* 8 */
    uint32_t hTargetDevice; /* 12 */
    uint32_t flags;         /* 16 */
    uint32_t pad0;          /* 20 */
    uint64_t vaSpaceSize;   /* 24 */
    uint64_t vaStartInternal; /* 32 */
    uint64_t vaLimitInternal; /* 40 */
    uint32_t vaMode;        /* 48 */
    uint32_t pad1;          /* 52 */
} NV0080_ALLOC_PARAMETERS; /* 56 B */

typedef struct {
    uint32_t subDeviceId;
} NV2080_ALLOC_PARAMETERS;

typedef struct {
    uint32_t index, flags;
    uint64_t vaSize, vaStartInternal, vaLimitInternal;
    uint32_t bigPageSize, pad;
    uint64_t vaBase;
} NV_VASPACE_ALLOCATION_PARAMETERS; /* 48 B */

typedef struct {
    uint32_t hRoot, hObjectParent, hObjectNew, hClass;
    uint64_t pAllocParms;
    uint32_t paramsSize, status;
} NVOS21_PARAMETERS; /* 32 B */

typedef struct {
    uint32_t hRoot, hObjectParent, hObjectNew, hClass;
    uint64_t pAllocParms;
    uint64_t pRightsRequested;
    uint32_t paramsSize, flags, status, pad;
} NVOS64_PARAMETERS; /* 48 B */

typedef struct {
    uint32_t hRoot, hObjectParent, hObjectOld, status;
} NVOS00_PARAMETERS; /* 16 B */

typedef struct {
    uint32_t owner;        /* 0 */
    uint32_t type;         /* 4 */
    uint32_t flags;        /* 8 */
    uint32_t width;        /* 12 */
    uint32_t height;       /* 16 */
    int32_t pitch;         /* 20 */
    uint32_t attr;         /* 24 */
    uint32_t attr2;        /* 28 */
    uint32_t format;       /* 32 */
    uint32_t comprCovg;    /* 36 */
    uint32_t zcullCovg;    /* 40 */
    uint32_t pad0;         /* 44 */
    uint64_t rangeLo;      /* 48 */
    uint64_t rangeHi;      /* 56 */
    uint64_t size;         /* 64 */
    uint64_t alignment;    /* 72 */
    uint64_t offset;       /* 80 */
    uint64_t limit;        /* 88 */
    uint64_t address;      /* 96 */
    uint32_t ctagOffset;   /* 104 */
    uint32_t hVASpace;     /* 108 */
    uint32_t internalflags;/* 112 */
    uint32_t tag;          /* 116 */
    uint64_t reserved;     /* 120: numaNode + pad on 550+ */
} NV_MEMORY_ALLOCATION_PARAMS; /* 128 B */

/* NVOS32 (VID_HEAP_CONTROL): the head, then a union whose AllocSize member is the
 * largest (144 B); FREE uses owner/hMemory/flags at the start of the union */
typedef struct {
    uint32_t hRoot;          /* 0 */
    uint32_t hObjectParent;  /* 4 */
    uint32_t function;       /* 8 */
    uint32_t hVASpace;       /* 12 */
    int16_t ivcHeapNumber;   /* 16 */
    uint16_t pad0;
    uint32_t status;         /* 20 */
    uint64_t total;          /* 24 */
    uint64_t free;           /* 32 */
    union {
        struct {
            uint32_t owner;      /* 40 */
            uint32_t hMemory;    /* 44 */
            uint32_t type;       /* 48 */
            uint32_t flags;      /* 52 */
            uint32_t attr;       /* 56 */
            uint32_t format;     /* 60 */
            uint32_t comprCovg;  /* 64 */
            uint32_t zcullCovg;  /* 68 */
            uint32_t partitionStride; /* 72 */
            uint32_t width;      /* 76 */
            uint32_t height;     /* 80 */
            uint32_t pad1;       /* 84 */
            uint64_t size;       /* 88 */
            uint64_t alignment;  /* 96 */
            uint64_t offset;     /* 104 */
            uint64_t limit;      /* 112 */
            uint64_t address;    /* 120 */
            uint64_t rangeBegin; /* 128 */
            uint64_t rangeEnd;   /* 136 */
            uint32_t attr2;      /* 144 */
            uint32_t ctagOffset; /* 148 */
            int32_t numaNode;    /* 152 */
            uint32_t pad2;       /* 156 */
            uint8_t rest[24];    /* the union's larger members */
        } AllocSize;
        struct {
            uint32_t owner;      /* 40 */
            uint32_t hMemory;    /* 44 */
            uint32_t flags;      /* 48 */
        } Free;
    } data;
} NVOS32_PARAMETERS; /* 184 B */

typedef struct {
    uint64_t flags;
    uint32_t rmStatus;
    uint32_t pad;
} UVM_INITIALIZE_PARAMS;

_Static_assert(sizeof(nv_ioctl_card_info_t) == 72, "nv_ioctl_card_info_t is 72 bytes");
_Static_assert(__builtin_offsetof(nv_ioctl_card_info_t, gpu_id) == 16, "gpu_id at 16");
_Static_assert(__builtin_offsetof(nv_ioctl_card_info_t, minor_number) == 56, "minor_number at 56");
_Static_assert(sizeof(NVOS54_PARAMETERS) == 32, "NVOS54 is 32 bytes");
_Static_assert(sizeof(NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS) == 32, "GET_ID_INFO_V2 params are 32 bytes");
_Static_assert(sizeof(NV0080_ALLOC_PARAMETERS) == 56, "NV0080 params are 56 bytes");
_Static_assert(sizeof(NVOS21_PARAMETERS) == 32, "NVOS21 is 32 bytes");
_Static_assert(sizeof(NVOS64_PARAMETERS) == 48, "NVOS64 is 48 bytes");
_Static_assert(sizeof(NVOS00_PARAMETERS) == 16, "NVOS00 is 16 bytes");
_Static_assert(sizeof(NV_MEMORY_ALLOCATION_PARAMS) == 128, "NV_MEMORY_ALLOCATION_PARAMS is 128 bytes");
_Static_assert(__builtin_offsetof(NV_MEMORY_ALLOCATION_PARAMS, size) == 64, "size at 64");
_Static_assert(sizeof(NVOS32_PARAMETERS) == 184, "NVOS32 is 184 bytes");
_Static_assert(__builtin_offsetof(NVOS32_PARAMETERS, status) == 20, "NVOS32 status at 20");
_Static_assert(__builtin_offsetof(NVOS32_PARAMETERS, data.AllocSize.hMemory) == 44, "hMemory at 44");
_Static_assert(__builtin_offsetof(NVOS32_PARAMETERS, data.AllocSize.attr) == 56, "attr at 56");
_Static_assert(__builtin_offsetof(NVOS32_PARAMETERS, data.AllocSize.size) == 88, "AllocSize.size at 88");
_Static_assert(__builtin_offsetof(NVOS32_PARAMETERS, data.AllocSize.offset) == 104, "offset at 104");
_Static_assert(__builtin_offsetof(NVOS32_PARAMETERS, data.AllocSize.attr2) == 144, "attr2 at 144");
_Static_assert(__builtin_offsetof(NVOS32_PARAMETERS, data.Free.flags) == 48, "Free.flags at 48");
_Static_assert(sizeof(UVM_INITIALIZE_PARAMS) == 16, "UVM_INITIALIZE_PARAMS is 16 bytes");

/* ---- process state ---- */

struct sim_ctx {
    int ordinal;   /* CUDA ordinal (after CUDA_VISIBLE_DEVICES) */
    int phys;      /* index in the state file */
};

/* what a cuMemAlloc* pointer stands for */
enum { REC_DIRECT = 0, REC_CARVED = 1, REC_MANAGED = 2, REC_POOL = 3 };

struct alloc_rec {
    CUdeviceptr ptr;   /* 0 = empty, 1 = tombstone */
    uint64_t size;     /* what the program asked for */
    uint64_t charged;  /* REC_CARVED, REC_POOL: bytes carved from the object; REC_MANAGED: mapped length */
    uint32_t handle;   /* RM memory object: its own (REC_DIRECT) or the one it is carved from */
    int phys;
    int kind;          /* REC_* */
};

/* A class-0x40 memory object RM holds for this process (the driver's view). */
enum { MEM_CONTEXT = 1, MEM_DIRECT = 2, MEM_CHUNK = 3, MEM_POOL = 4, MEM_VMM = 5 };

struct sim_pool; /* a CUmemoryPool (below) */

struct rm_mem {
    uint32_t handle;
    int phys;
    int kind;          /* MEM_* */
    uint64_t size;     /* the rounded size RM wrote back */
    uint64_t carved;   /* MEM_CHUNK, MEM_POOL: bytes of live allocations carved from it */
    uint32_t users;    /* MEM_CHUNK, MEM_POOL: live allocations in it; MEM_VMM: mappings */
    struct sim_pool *pool; /* MEM_POOL: the pool that holds it */
    int released;      /* MEM_VMM: cuMemRelease was called (freed when the last mapping goes) */
};

enum { PATH_RM_ALLOC = 0, PATH_VID_HEAP = 1 };
enum { TEARDOWN_FREE_DEVICE = 0, TEARDOWN_FREE_CLIENT = 1, TEARDOWN_CLOSE_FD = 2 };
enum { PARAMS_SIZE_ZERO = 0, PARAMS_SIZE_CLASS = 1 };

/* The defaults are what real CUDA does (the H100 recording; top of this file). */
#define DEFAULT_SUBALLOC_MIB 2ULL  /* a cuMemAlloc below 2 MiB is carved from a 2 MiB object */
#define DEFAULT_CONTEXT_MIB 518ULL /* NVML per-process after cuCtxCreate on the H100 */

static struct {
    int alloc_path;           /* PATH_* */
    uint64_t suballoc_bytes;  /* 0: one driver allocation per cuMemAlloc */
    uint64_t context_bytes;   /* a context's own memory */
    int params_size;          /* PARAMS_SIZE_*: what RM_ALLOC says in paramsSize */
    int teardown;             /* TEARDOWN_* */
} g_cfg;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_inited;
static struct sim_handle g_sim;
static struct sim_self g_self;
static int g_slot = -1;
static int g_visible[SIM_MAX_DEVICES];
static int g_visible_count;
static int g_ctl_fd = -1;
static int g_uvm_fd = -1;
static int g_uvm_initialized;
static int g_dev_fd[SIM_MAX_DEVICES];
static uint32_t g_hroot;
static uint32_t g_next_handle = 0xcaf00001u;
static CUdeviceptr g_next_va = 0x7f0000000000ULL;
static struct alloc_rec *g_allocs;
static size_t g_alloc_cap;
static size_t g_alloc_used;
static struct rm_mem *g_mem;
static size_t g_mem_count, g_mem_cap;
static __thread struct sim_ctx *t_ctx;
/* threads of one process take turns on a device's engine (one context per process) */
static pthread_mutex_t g_launch_lock[SIM_MAX_DEVICES];
static int g_client_allocated;      /* the RM client exists (on g_ctl_fd) */
static uint32_t g_pool_sysmem;      /* devices whose pool system-memory object (0x3E) exists */
struct vmm_map {                    /* a cuMemMap: which VMM object is mapped at va */
    CUdeviceptr va;
    uint32_t handle;
};
static struct vmm_map *g_maps;
static size_t g_map_count, g_map_cap;
static uint32_t g_devices_allocated; /* devices whose NV01_DEVICE_0 (and children) exist */
static int g_ctx_count[SIM_MAX_DEVICES]; /* live contexts per device */

static void atfork_child(void)
{
    /* A forked child owns no slot, no liveness lock, no RM objects and no allocations
     * (its parent's stay the parent's), and must not share the parent's open file
     * description: flock() locks belong to it, so parent and child would not exclude
     * each other. */
    g_slot = -1;
    g_client_allocated = 0;
    g_devices_allocated = 0;
    g_uvm_initialized = 0;
    g_allocs = NULL;
    g_alloc_cap = g_alloc_used = 0;
    g_mem = NULL;
    g_mem_count = g_mem_cap = 0;
    g_pool_sysmem = 0;
    g_maps = NULL;
    g_map_count = g_map_cap = 0;
    memset(g_ctx_count, 0, sizeof(g_ctx_count));
    pthread_mutex_init(&g_lock, NULL);
    for (int i = 0; i < SIM_MAX_DEVICES; i++)
        pthread_mutex_init(&g_launch_lock[i], NULL);
    sim_after_fork_child();
    sim_self_identity(&g_self);
    t_ctx = NULL;
    if (g_inited && sim_reopen(sim_state_path(), &g_sim, 1) < 0)
        g_inited = 0;
}

/* Read the per-process configuration (see the top of this file). 0, or -1 after
 * telling stderr what is wrong. */
static int parse_config(void)
{
    memset(&g_cfg, 0, sizeof(g_cfg));
    g_cfg.suballoc_bytes = DEFAULT_SUBALLOC_MIB << 20;
    g_cfg.context_bytes = DEFAULT_CONTEXT_MIB << 20;
    const char *path = getenv("GPUWATCH_SIM_ALLOC_PATH");
    if (path && *path) {
        if (strcmp(path, "rm-alloc") == 0)
            g_cfg.alloc_path = PATH_RM_ALLOC;
        else if (strcmp(path, "vid-heap") == 0)
            g_cfg.alloc_path = PATH_VID_HEAP;
        else {
            fprintf(stderr, "gpuwatch-sim libcuda: GPUWATCH_SIM_ALLOC_PATH=%s: use rm-alloc or vid-heap\n", path);
            return -1;
        }
    }
    static const char *const mib_vars[2] = {"GPUWATCH_SIM_SUBALLOC_MIB", "GPUWATCH_SIM_CONTEXT_MIB"};
    uint64_t *const mib_out[2] = {&g_cfg.suballoc_bytes, &g_cfg.context_bytes};
    for (int i = 0; i < 2; i++) {
        const char *v = getenv(mib_vars[i]);
        if (!v || !*v)
            continue;
        char *end;
        errno = 0;
        unsigned long long mib = strtoull(v, &end, 10);
        if (errno || *end || *v == '-' || mib > (1ULL << 20)) {
            fprintf(stderr, "gpuwatch-sim libcuda: %s=%s: use a whole number of MiB (0..1048576)\n", mib_vars[i], v);
            return -1;
        }
        *mib_out[i] = (uint64_t)mib << 20;
    }
    const char *ps = getenv("GPUWATCH_SIM_RM_PARAMS_SIZE");
    if (ps && *ps) {
        if (strcmp(ps, "zero") == 0)
            g_cfg.params_size = PARAMS_SIZE_ZERO;
        else if (strcmp(ps, "class") == 0)
            g_cfg.params_size = PARAMS_SIZE_CLASS;
        else {
            fprintf(stderr, "gpuwatch-sim libcuda: GPUWATCH_SIM_RM_PARAMS_SIZE=%s: use zero or class\n", ps);
            return -1;
        }
    }
    const char *td = getenv("GPUWATCH_SIM_CTX_TEARDOWN");
    if (td && *td) {
        if (strcmp(td, "free-device") == 0)
            g_cfg.teardown = TEARDOWN_FREE_DEVICE;
        else if (strcmp(td, "free-client") == 0)
            g_cfg.teardown = TEARDOWN_FREE_CLIENT;
        else if (strcmp(td, "close-fd") == 0)
            g_cfg.teardown = TEARDOWN_CLOSE_FD;
        else {
            fprintf(stderr,
                    "gpuwatch-sim libcuda: GPUWATCH_SIM_CTX_TEARDOWN=%s: use free-device, free-client or close-fd\n",
                    td);
            return -1;
        }
    }
    return 0;
}

static int parse_visible(void)
{
    int n = (int)g_sim.hdr->device_count;
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    g_visible_count = 0;
    if (!env) {
        for (int i = 0; i < n && i < SIM_MAX_DEVICES; i++)
            g_visible[g_visible_count++] = i;
        return 0;
    }
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", env);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        int idx = -1;
        if (strncmp(tok, "GPU-", 4) == 0) {
            for (int i = 0; i < n; i++)
                if (strncmp(g_sim.hdr->devices[i].uuid, tok, strlen(tok)) == 0)
                    idx = i;
        } else {
            char *end;
            long v = strtol(tok, &end, 10);
            if (end != tok && *end == 0 && v >= 0 && v < n)
                idx = (int)v;
        }
        /* like the real driver, an invalid entry hides it and everything after it */
        if (idx < 0 || g_visible_count >= SIM_MAX_DEVICES)
            break;
        g_visible[g_visible_count++] = idx;
    }
    return 0;
}

static CUresult ensure_init(void)
{
    if (g_inited)
        return CUDA_SUCCESS;
    return CUDA_ERROR_NOT_INITIALIZED;
}

static void ensure_ctl_locked(void);

API CUresult cuInit(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&g_lock);
    if (!g_inited) {
        if (parse_config() < 0) {
            pthread_mutex_unlock(&g_lock);
            return CUDA_ERROR_INVALID_VALUE;
        }
        int rc = sim_open(sim_state_path(), &g_sim);
        if (rc < 0) {
            pthread_mutex_unlock(&g_lock);
            return CUDA_ERROR_NO_DEVICE;
        }
        for (int i = 0; i < SIM_MAX_DEVICES; i++) {
            g_dev_fd[i] = -1;
            pthread_mutex_init(&g_launch_lock[i], NULL);
        }
        sim_self_identity(&g_self);
        parse_visible();
        pthread_atfork(NULL, NULL, atfork_child);
        g_inited = 1;
        ensure_ctl_locked(); /* nvidiactl + CARD_INFO, as the real driver library does first */
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = g_inited ? (int)g_sim.hdr->cuda_driver_version : 12040;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count)
{
    CUresult r = ensure_init();
    if (r)
        return r;
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = g_visible_count;
    return CUDA_SUCCESS;
}

static int phys_of(CUdevice d)
{
    if (d < 0 || d >= g_visible_count)
        return -1;
    return g_visible[d];
}

API CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    CUresult r = ensure_init();
    if (r)
        return r;
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    if (phys_of(ordinal) < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice d)
{
    CUresult r = ensure_init();
    if (r)
        return r;
    int p = phys_of(d);
    if (p < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", g_sim.hdr->devices[p].name);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    CUresult r = ensure_init();
    if (r)
        return r;
    int p = phys_of(d);
    if (p < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = g_sim.hdr->devices[p].memory_total_bytes;
    return CUDA_SUCCESS;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice d)
{
    CUresult r = ensure_init();
    if (r)
        return r;
    int p = phys_of(d);
    if (p < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    const char *s = g_sim.hdr->devices[p].uuid + 4; /* skip "GPU-" */
    int k = 0;
    for (; *s && k < 16; s++) {
        if (*s == '-')
            continue;
        int hi = hexval(s[0]), lo = s[1] ? hexval(s[1]) : -1;
        if (hi < 0 || lo < 0)
            break;
        uuid->bytes[k++] = (char)(hi * 16 + lo);
        s++;
    }
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice d)
{
    return cuDeviceGetUuid(uuid, d);
}

/* ---- slot registration (under the exclusive state lock) ---- */

static int claim_slot_locked(void)
{
    if (g_slot >= 0)
        return g_slot;
    struct sim_header *h = g_sim.hdr;
    int chosen = -1;
    uint32_t hw = h->proc_high_water;
    struct sim_live *live = malloc(sizeof(*live));
    if (!live)
        return -1;
    sim_liveness(&g_sim, &g_self, live);
    /* Reuse a free slot whose busy history has aged out (so utilisation keeps counting
     * work of processes that died within the history); grow the table otherwise; and
     * when it is full, take any free slot. */
    uint32_t now_epoch = (uint32_t)(sim_realtime_ns() / SIM_BUCKET_NS);
    int any_free = -1;
    for (uint32_t i = 0; i < live->count; i++) {
        if (h->procs[i].in_use && live->pid[i] >= 0)
            continue;
        if (any_free < 0)
            any_free = (int)i;
        if (now_epoch - h->procs[i].last_busy_epoch > SIM_BUCKETS) {
            chosen = (int)i;
            break;
        }
    }
    free(live);
    if (chosen < 0 && hw < SIM_MAX_PROCS) {
        chosen = (int)hw;
        h->proc_high_water = hw + 1;
    }
    if (chosen < 0)
        chosen = any_free;
    if (chosen < 0)
        return -1;
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(SIM_LIVE_LOCK_BASE + (uint64_t)chosen);
    fl.l_len = 1;
    if (fcntl(g_sim.fd, F_SETLK, &fl) < 0)
        return -1;
    struct sim_proc *p = &h->procs[chosen];
    uint64_t gen = p->generation + 1;
    memset(p, 0, sizeof(*p));
    for (int d = 0; d < SIM_MAX_DEVICES; d++) /* a dead waiter's place is not inherited */
        __atomic_store_n(&h->engines[d].wait_ticket[chosen], 0, __ATOMIC_SEQ_CST);
    p->ns_pid = g_self.ns_pid;
    p->pidns_ino = g_self.pidns_ino;
    p->start_ticks = g_self.start_ticks;
    p->generation = gen;
    __atomic_store_n(&p->in_use, 1, __ATOMIC_RELEASE);
    g_slot = chosen;
    g_hroot = 0xc1d00000u | ((uint32_t)g_self.ns_pid & 0xfffffu);
    return chosen;
}

static int ensure_slot(void)
{
    if (g_slot >= 0)
        return g_slot;
    sim_lock(&g_sim, 1);
    int s = claim_slot_locked();
    sim_unlock(&g_sim);
    return s;
}

/* ---- contexts: current context ---- */

API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    t_ctx = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetDevice(CUdevice *d)
{
    if (!t_ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    *d = t_ctx->ordinal;
    return CUDA_SUCCESS;
}

static void pools_synchronized(int phys);

/* A synchronize trims the device's pools to their release threshold (default 0), as the
 * real driver does: on the H100, cuMemFreeAsync + cuStreamSynchronize freed the pool's
 * memory object. */
API CUresult cuCtxSynchronize(void)
{
    if (!t_ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    pools_synchronized(t_ctx->phys);
    return CUDA_SUCCESS;
}

API CUresult cuStreamSynchronize(CUstream s)
{
    (void)s;
    if (!t_ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    pools_synchronized(t_ctx->phys);
    return CUDA_SUCCESS;
}

/* ---- allocation records (process-local open addressing) ---- */

static uint64_t hash_ptr(CUdeviceptr p)
{
    p ^= p >> 33;
    p *= 0xff51afd7ed558ccdULL;
    p ^= p >> 33;
    return p;
}

static int allocs_grow(void)
{
    size_t cap = g_alloc_cap ? g_alloc_cap * 2 : 1024;
    struct alloc_rec *n = calloc(cap, sizeof(*n));
    if (!n)
        return -1;
    for (size_t i = 0; i < g_alloc_cap; i++) {
        if (g_allocs[i].ptr > 1) {
            size_t j = hash_ptr(g_allocs[i].ptr) & (cap - 1);
            while (n[j].ptr)
                j = (j + 1) & (cap - 1);
            n[j] = g_allocs[i];
        }
    }
    free(g_allocs);
    g_allocs = n;
    g_alloc_cap = cap;
    return 0;
}

static int allocs_put(struct alloc_rec rec)
{
    if ((g_alloc_used + 1) * 2 > g_alloc_cap && allocs_grow() < 0)
        return -1;
    size_t j = hash_ptr(rec.ptr) & (g_alloc_cap - 1);
    while (g_allocs[j].ptr > 1)
        j = (j + 1) & (g_alloc_cap - 1);
    g_allocs[j] = rec;
    g_alloc_used++;
    return 0;
}

static int allocs_take(CUdeviceptr ptr, struct alloc_rec *out)
{
    if (!g_alloc_cap)
        return -1;
    size_t j = hash_ptr(ptr) & (g_alloc_cap - 1);
    for (size_t n = 0; n < g_alloc_cap && g_allocs[j].ptr; n++) {
        if (g_allocs[j].ptr == ptr) {
            *out = g_allocs[j];
            g_allocs[j].ptr = 1; /* tombstone */
            return 0;
        }
        j = (j + 1) & (g_alloc_cap - 1);
    }
    return -1;
}

/* one RM_ALLOC ioctl on nvidiactl in the node's parameter layout (NVOS64 or NVOS21) */
/* ---- driver model: the traffic the real driver sees, and RM's ledger ----
 *
 * Handles (chosen by the caller, as libcuda does): the client 0xc1d00000 | pid (hRoot ==
 * hObjectNew of its RM_ALLOC), device 0xde000000 | gpu, subdevice 0x5d000000 | gpu, VA
 * space 0x7a000000 | gpu, memory objects 0xcaf00001 upwards. Device objects take RM's
 * device instance as deviceId (the state file's device_instance: reversed order, so it
 * differs from the minor on nodes of two or more GPUs), learnt like libcuda does: CARD_INFO
 * gives (gpu_id, minor) of every GPU, NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 turns gpu_id
 * into the device instance.
 *
 * No kernel driver runs (the nodes are /dev/null and /dev/zero), so the stub is the
 * driver: it writes RM's answer -- status, the rounded size, the heap totals, the control's
 * output -- into the parameters BEFORE it issues the syscall. A probe that reads the
 * parameters at syscall exit (as it must on a real GPU, where RM writes them during the
 * call) sees the answer; one that reads them at entry sees it too, which the real driver
 * would not show it.
 *
 * Sizes (RM's page sizes): an object of 2 MiB or more is rounded up to a multiple of
 * 2 MiB, a smaller one to a multiple of 64 KiB. NVML's per-process used memory is the
 * sum of the process's live class-0x40 memory objects at those sizes (context memory,
 * chunks -- not the cuMemAllocs carved from them --, pool and VMM objects); managed memory
 * is not in it (the H100 recording: a 64 MiB managed range left NVML's number unchanged).
 */
#define RM_BIG_PAGE_BYTES (2ULL << 20)
#define RM_SMALL_PAGE_BYTES (64ULL << 10)
#define UVM_CHUNK_BYTES (2ULL << 20)    /* managed memory is resident in 2 MiB chunks */
#define CARVE_ALIGN_BYTES 512ULL        /* cuMemAlloc alignment inside a chunk */
#define POOL_CHUNK_BYTES (32ULL << 20)  /* a pool reserves memory in 32 MiB objects (H100: 16 MiB -> +32) */
#define VMM_GRANULARITY_BYTES (2ULL << 20) /* cuMemGetAllocationGranularity on the H100 */

/* The recorded H100 context's class-0x40 objects in MiB, in order (RM_ALLOCs between
 * cuCtxCreate and its return in tests/fixtures/traces/real/580.159.04-nvidia-h100-80gb-hbm3/
 * cuda_exercise.jsonl; each size is the nvidia-uvm UVM_CREATE_EXTERNAL_RANGE issued right
 * after it): 6, fourteen of 2, 70, then 414 -- the rest of the 518 MiB, which is the last
 * object here whatever the context size. */
static const uint64_t k_context_objects_mib[] = {6, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 70};

static uint64_t round_up(uint64_t v, uint64_t to)
{
    return (v + to - 1) / to * to;
}

static uint64_t rm_rounded_size(uint64_t bytes)
{
    return round_up(bytes, bytes >= RM_BIG_PAGE_BYTES ? RM_BIG_PAGE_BYTES : RM_SMALL_PAGE_BYTES);
}

static uint32_t device_handle(int phys)
{
    return 0xde000000u | (uint32_t)phys;
}

static uint32_t subdevice_handle(int phys)
{
    return 0x5d000000u | (uint32_t)phys;
}

static uint32_t vaspace_handle(int phys)
{
    return 0x7a000000u | (uint32_t)phys;
}

/* one RM_ALLOC ioctl on nvidiactl in the node's parameter layout (NVOS64 or NVOS21),
 * with RM's `status` already written. `params_size` is the size of the class's parameters;
 * paramsSize says it only with GPUWATCH_SIM_RM_PARAMS_SIZE=class: real libcuda (580, CUDA 13)
 * sends 0 on every RM_ALLOC and RM sizes pAllocParms by the class. */
static void rm_alloc(uint32_t h_root, uint32_t h_parent, uint32_t h_new, uint32_t h_class, void *params,
                     uint32_t params_size, uint32_t status)
{
    if (g_ctl_fd < 0)
        return;
    if (g_cfg.params_size == PARAMS_SIZE_ZERO)
        params_size = 0;
    if (g_sim.hdr->rm_alloc_params == SIM_RMALLOC_NVOS21) {
        NVOS21_PARAMETERS p;
        memset(&p, 0, sizeof(p));
        p.hRoot = h_root;
        p.hObjectParent = h_parent;
        p.hObjectNew = h_new;
        p.hClass = h_class;
        p.pAllocParms = (uint64_t)(uintptr_t)params;
        p.paramsSize = params_size;
        p.status = status;
        (void)ioctl(g_ctl_fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_ALLOC, NVOS21_PARAMETERS), &p);
    } else {
        NVOS64_PARAMETERS p;
        memset(&p, 0, sizeof(p));
        p.hRoot = h_root;
        p.hObjectParent = h_parent;
        p.hObjectNew = h_new;
        p.hClass = h_class;
        p.pAllocParms = (uint64_t)(uintptr_t)params;
        p.paramsSize = params_size;
        p.status = status;
        (void)ioctl(g_ctl_fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_ALLOC, NVOS64_PARAMETERS), &p);
    }
}

static void rm_free(uint32_t h_parent, uint32_t h_old)
{
    if (g_ctl_fd < 0)
        return;
    NVOS00_PARAMETERS p;
    p.hRoot = g_hroot;
    p.hObjectParent = h_parent;
    p.hObjectOld = h_old;
    p.status = NV_OK;
    (void)ioctl(g_ctl_fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_FREE, NVOS00_PARAMETERS), &p);
}

static void rm_control(uint32_t h_object, uint32_t cmd, void *params, uint32_t params_size)
{
    if (g_ctl_fd < 0)
        return;
    NVOS54_PARAMETERS p;
    memset(&p, 0, sizeof(p));
    p.hClient = g_hroot;
    p.hObject = h_object;
    p.cmd = cmd;
    p.params = (uint64_t)(uintptr_t)params;
    p.paramsSize = params_size;
    p.status = NV_OK;
    (void)ioctl(g_ctl_fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_CONTROL, NVOS54_PARAMETERS), &p);
}

/* The memory-object allocation in the process's chosen path, RM's answer written in:
 * RM_ALLOC of NV01_MEMORY_LOCAL_USER with NV_MEMORY_ALLOCATION_PARAMS, or
 * VID_HEAP_CONTROL ALLOC_SIZE (NVOS32, LOCATION VIDMEM) -- which makes the same object. */
static void issue_mem_alloc(uint32_t handle, int phys, uint64_t requested, uint64_t rounded, uint32_t status)
{
    if (g_ctl_fd < 0)
        return;
    if (g_cfg.alloc_path == PATH_VID_HEAP) {
        NVOS32_PARAMETERS p;
        memset(&p, 0, sizeof(p));
        p.hRoot = g_hroot;
        p.hObjectParent = device_handle(phys);
        p.function = NVOS32_FUNCTION_ALLOC_SIZE;
        p.hVASpace = 0;
        p.status = status;
        uint64_t total = g_sim.hdr->devices[phys].memory_total_bytes;
        uint64_t used = g_slot >= 0 ? g_sim.hdr->procs[g_slot].memory_bytes[phys] : 0;
        p.total = total;
        p.free = used < total ? total - used : 0; /* approximate: this process's view */
        p.data.AllocSize.owner = g_hroot;
        p.data.AllocSize.hMemory = handle;
        p.data.AllocSize.type = NVOS32_TYPE_IMAGE;
        p.data.AllocSize.flags = NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED;
        p.data.AllocSize.attr = NVOS32_ATTR_LOCATION_VIDMEM << 25;
        p.data.AllocSize.size = status == NV_OK ? rounded : requested;
        p.data.AllocSize.offset = status == NV_OK ? (uint64_t)(handle & 0xfffffu) << 21 : 0;
        p.data.AllocSize.limit = status == NV_OK ? rounded - 1 : 0;
        (void)ioctl(g_ctl_fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_VID_HEAP_CONTROL, NVOS32_PARAMETERS), &p);
        return;
    }
    NV_MEMORY_ALLOCATION_PARAMS mp;
    memset(&mp, 0, sizeof(mp));
    mp.owner = g_hroot;
    mp.type = NVOS32_TYPE_IMAGE;
    mp.attr = NVOS32_ATTR_LOCATION_VIDMEM << 25;
    mp.size = status == NV_OK ? rounded : requested;
    mp.limit = status == NV_OK ? rounded - 1 : 0;
    rm_alloc(g_hroot, device_handle(phys), handle, NV01_MEMORY_LOCAL_USER, &mp, sizeof(mp), status);
}

static void issue_mem_free(uint32_t handle, int phys)
{
    if (g_cfg.alloc_path == PATH_VID_HEAP) {
        if (g_ctl_fd < 0)
            return;
        NVOS32_PARAMETERS p;
        memset(&p, 0, sizeof(p));
        p.hRoot = g_hroot;
        p.hObjectParent = device_handle(phys);
        p.function = NVOS32_FUNCTION_FREE;
        p.status = NV_OK;
        p.data.Free.owner = g_hroot;
        p.data.Free.hMemory = handle;
        p.data.Free.flags = NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED;
        (void)ioctl(g_ctl_fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_VID_HEAP_CONTROL, NVOS32_PARAMETERS), &p);
        return;
    }
    rm_free(device_handle(phys), handle);
}

/* nvidiactl open, and CARD_INFO on it: every GPU's gpu_id and minor (g_lock held) */
static void ensure_ctl_locked(void)
{
    if (g_ctl_fd >= 0)
        return;
    char path[SIM_PATH_LEN + 32];
    snprintf(path, sizeof(path), "%s/dev/nvidiactl", g_sim.hdr->root);
    g_ctl_fd = open(path, O_RDWR | O_CLOEXEC);
    if (g_ctl_fd < 0)
        return;
    nv_ioctl_card_info_t cards[NV_MAX_CARDS];
    memset(cards, 0, sizeof(cards));
    for (uint32_t i = 0; i < g_sim.hdr->device_count && i < NV_MAX_CARDS; i++) {
        const struct sim_device *d = &g_sim.hdr->devices[i];
        cards[i].valid = 1;
        cards[i].bus = (uint8_t)d->pci_bus;
        cards[i].vendor_id = 0x10de;
        cards[i].gpu_id = d->gpu_id;
        cards[i].fb_size = d->memory_total_bytes;
        cards[i].minor_number = d->minor;
    }
    (void)ioctl(g_ctl_fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_CARD_INFO, nv_ioctl_card_info_t[NV_MAX_CARDS]), cards);
}

/* the RM client of this process (g_lock held) */
static void ensure_client_locked(void)
{
    ensure_ctl_locked();
    if (g_client_allocated)
        return;
    g_hroot = 0xc1d00000u | ((uint32_t)g_self.ns_pid & 0xfffffu);
    rm_alloc(g_hroot, g_hroot, g_hroot, NV01_ROOT_CLIENT, NULL, 0, NV_OK);
    g_client_allocated = 1;
}

/* ---- the ledger (RM's per-process accounting, in the shared state) ---- */

struct ledger_delta {
    int64_t rm_bytes, rm_objects, context_bytes, managed_bytes, requested_bytes, allocations;
};

/* Apply a change to this process's ledger on `phys`. With `check_room`, refuse (-1) when
 * the memory it adds does not fit on the device; -2 when no process slot is left. */
static int ledger_apply(int phys, const struct ledger_delta *d, int check_room)
{
    sim_lock(&g_sim, 1);
    int slot = claim_slot_locked();
    if (slot < 0) {
        sim_unlock(&g_sim);
        return -2;
    }
    if (check_room) {
        uint64_t grow = (uint64_t)(d->rm_bytes > 0 ? d->rm_bytes : 0); /* managed memory oversubscribes */
        uint64_t total = g_sim.hdr->devices[phys].memory_total_bytes;
        /* Every slot in use counted, dead or alive, is an upper bound on the live sum: when it
         * fits, the allocation fits, and /proc/locks (whose cost grows with every lock on the
         * host) is read only when the dead may have to be reaped to make room. */
        uint64_t used = grow ? sim_used_bytes_in_use(&g_sim, phys) : 0;
        if (grow && used + grow > total)
            used = sim_device_used_bytes(&g_sim, phys, &g_self, 1);
        if (grow && used + grow > total) {
            sim_unlock(&g_sim);
            return -1;
        }
    }
    struct sim_proc *p = &g_sim.hdr->procs[slot];
    p->rm_memory_bytes[phys] += (uint64_t)d->rm_bytes;
    p->rm_objects[phys] += (uint64_t)d->rm_objects;
    p->context_bytes[phys] += (uint64_t)d->context_bytes;
    p->managed_bytes[phys] += (uint64_t)d->managed_bytes;
    p->requested_bytes[phys] += (uint64_t)d->requested_bytes;
    p->allocations[phys] += (uint64_t)d->allocations;
    p->memory_bytes[phys] = p->rm_memory_bytes[phys]; /* NVML: RM's objects, never managed memory */
    sim_unlock(&g_sim);
    return 0;
}

/* ---- RM memory objects of this process (g_lock held) ---- */

static struct rm_mem *mem_add(uint32_t handle, int phys, int kind, uint64_t size)
{
    if (g_mem_count == g_mem_cap) {
        size_t cap = g_mem_cap ? g_mem_cap * 2 : 64;
        struct rm_mem *n = realloc(g_mem, cap * sizeof(*n));
        if (!n)
            return NULL;
        g_mem = n;
        g_mem_cap = cap;
    }
    struct rm_mem *m = &g_mem[g_mem_count++];
    memset(m, 0, sizeof(*m));
    m->handle = handle;
    m->phys = phys;
    m->kind = kind;
    m->size = size;
    return m;
}

static struct rm_mem *mem_find(uint32_t handle)
{
    for (size_t i = 0; i < g_mem_count; i++)
        if (g_mem[i].handle == handle)
            return &g_mem[i];
    return NULL;
}

static void mem_remove(struct rm_mem *m)
{
    *m = g_mem[--g_mem_count];
}

/* A new memory object of `requested` bytes on `phys`: ledger first (RM refuses what does
 * not fit, and says so in the status it writes back), then the driver call. `with` is
 * applied to the ledger in the same step (a cuMemAlloc's own counts). Returns its handle,
 * or 0 with *err set (CUDA_ERROR_OUT_OF_MEMORY when the device is full). */
static uint32_t mem_create(int phys, int kind, uint64_t requested, const struct ledger_delta *with, CUresult *err)
{
    uint64_t rounded = rm_rounded_size(requested);
    struct ledger_delta d = with ? *with : (struct ledger_delta){0};
    d.rm_bytes = (int64_t)rounded;
    d.rm_objects = 1;
    d.context_bytes = kind == MEM_CONTEXT ? (int64_t)rounded : 0;
    uint32_t handle = g_next_handle++;
    int rc = ledger_apply(phys, &d, 1);
    if (rc < 0) {
        if (rc == -1)
            issue_mem_alloc(handle, phys, requested, rounded, NV_ERR_NO_MEMORY);
        *err = rc == -1 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN;
        return 0;
    }
    if (!mem_add(handle, phys, kind, rounded)) {
        struct ledger_delta undo = {-(int64_t)rounded, -1, -d.context_bytes, -d.managed_bytes, -d.requested_bytes,
                                    -d.allocations};
        ledger_apply(phys, &undo, 0);
        *err = CUDA_ERROR_OUT_OF_MEMORY;
        return 0;
    }
    issue_mem_alloc(handle, phys, requested, rounded, NV_OK);
    return handle;
}

/* free one memory object by handle (cuMemFree of its last user); `with` as for mem_create */
static void mem_destroy(struct rm_mem *m, const struct ledger_delta *with)
{
    issue_mem_free(m->handle, m->phys);
    struct ledger_delta d = with ? *with : (struct ledger_delta){0};
    d.rm_bytes = -(int64_t)m->size;
    d.rm_objects = -1;
    d.context_bytes = m->kind == MEM_CONTEXT ? -(int64_t)m->size : 0;
    int phys = m->phys;
    mem_remove(m);
    ledger_apply(phys, &d, 0);
}

/* ---- contexts ---- */

static void open_nodes(int phys)
{
    char path[SIM_PATH_LEN + 32];
    const char *root = g_sim.hdr->root;
    if (g_dev_fd[phys] < 0) {
        snprintf(path, sizeof(path), "%s/dev/nvidia%u", root, g_sim.hdr->devices[phys].minor);
        g_dev_fd[phys] = open(path, O_RDWR | O_CLOEXEC);
    }
    if (g_uvm_fd < 0) {
        snprintf(path, sizeof(path), "%s/dev/nvidia-uvm", root);
        g_uvm_fd = open(path, O_RDWR | O_CLOEXEC);
    }
}

/* The size of the next context object when `left` bytes of context memory remain to be
 * allocated and `index` objects were: the recorded pieces in order, the rest in one object.
 * A piece is capped at what is left and kept a multiple of 2 MiB (so RM's rounding adds
 * nothing: the objects add up to exactly GPUWATCH_SIM_CONTEXT_MIB); an odd last MiB is a
 * 1 MiB object. */
static uint64_t context_piece(size_t index, uint64_t left)
{
    size_t n = sizeof(k_context_objects_mib) / sizeof(k_context_objects_mib[0]);
    uint64_t piece = index < n ? k_context_objects_mib[index] << 20 : left;
    if (piece > left)
        piece = left;
    if (piece >= RM_BIG_PAGE_BYTES)
        piece -= piece % RM_BIG_PAGE_BYTES;
    return piece;
}

/* What a context creation asks the driver for on a device the process has no objects on
 * yet: the device instance of its gpu_id (GET_ID_INFO_V2), NV01_DEVICE_0 (deviceId = that
 * instance), NV20_SUBDEVICE_0 and a FERMI_VASPACE_A under it, then the context's own
 * memory (GPUWATCH_SIM_CONTEXT_MIB, default 518, as the recorded context's objects:
 * context_piece). g_lock held. */
static CUresult device_setup_locked(int phys)
{
    ensure_client_locked();
    if (g_devices_allocated & (1u << phys))
        return CUDA_SUCCESS;
    const struct sim_device *dev = &g_sim.hdr->devices[phys];
    NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS id;
    memset(&id, 0, sizeof(id));
    id.gpuId = dev->gpu_id;
    id.deviceInstance = dev->device_instance; /* RM's answer, written before the call */
    id.subDeviceInstance = 0;
    id.numaId = -1;
    rm_control(g_hroot, NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2, &id, sizeof(id));
    NV0080_ALLOC_PARAMETERS dp;
    memset(&dp, 0, sizeof(dp));
    dp.deviceId = id.deviceInstance;
    dp.hClientShare = g_hroot;
    rm_alloc(g_hroot, g_hroot, device_handle(phys), NV01_DEVICE_0, &dp, sizeof(dp), NV_OK);
    NV2080_ALLOC_PARAMETERS sp = {0};
    rm_alloc(g_hroot, device_handle(phys), subdevice_handle(phys), NV20_SUBDEVICE_0, &sp, sizeof(sp), NV_OK);
    NV_VASPACE_ALLOCATION_PARAMETERS vp;
    memset(&vp, 0, sizeof(vp));
    rm_alloc(g_hroot, device_handle(phys), vaspace_handle(phys), FERMI_VASPACE_A, &vp, sizeof(vp), NV_OK);
    g_devices_allocated |= 1u << phys;
    size_t index = 0;
    for (uint64_t left = g_cfg.context_bytes; left > 0; index++) {
        uint64_t piece = context_piece(index, left);
        CUresult err = CUDA_SUCCESS;
        if (!mem_create(phys, MEM_CONTEXT, piece, NULL, &err))
            return err;
        left -= piece;
    }
    return CUDA_SUCCESS;
}

/* The objects of `phys` are gone from RM (their parent was freed, or the client, or the
 * fd): drop this process's allocations there and their share of the ledger. No ioctl. */
static void device_forget_locked(int phys)
{
    struct ledger_delta d = {0};
    for (size_t i = 0; i < g_alloc_cap; i++) {
        struct alloc_rec *r = &g_allocs[i];
        if (r->ptr <= 1 || r->phys != phys)
            continue;
        if (r->kind == REC_MANAGED) {
            munmap((void *)(uintptr_t)r->ptr, r->charged);
            d.managed_bytes -= (int64_t)r->charged;
        }
        d.requested_bytes -= (int64_t)r->size;
        r->ptr = 1; /* tombstone */
        g_alloc_used--;
    }
    for (size_t i = 0; i < g_mem_count;) {
        struct rm_mem *m = &g_mem[i];
        if (m->phys != phys) {
            i++;
            continue;
        }
        d.rm_bytes -= (int64_t)m->size;
        d.rm_objects -= 1;
        if (m->kind == MEM_CONTEXT)
            d.context_bytes -= (int64_t)m->size;
        if (m->kind == MEM_VMM)
            d.requested_bytes -= (int64_t)m->size; /* a VMM object is its own request until freed */
        mem_remove(m);
    }
    g_devices_allocated &= ~(1u << phys);
    g_pool_sysmem &= ~(1u << phys); /* the pool's system memory went with the device */
    ledger_apply(phys, &d, 0);
    if (g_slot >= 0)
        __atomic_fetch_and(&g_sim.hdr->procs[g_slot].context_mask, ~(1u << phys), __ATOMIC_RELAXED);
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d)
{
    (void)flags;
    CUresult r = ensure_init();
    if (r)
        return r;
    int p = phys_of(d);
    if (p < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (g_sim.hdr->devices[p].lost)
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    struct sim_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    int slot = ensure_slot();
    if (slot < 0) {
        pthread_mutex_unlock(&g_lock);
        free(c);
        return CUDA_ERROR_UNKNOWN;
    }
    open_nodes(p);
    r = device_setup_locked(p);
    if (r != CUDA_SUCCESS) {
        /* the context's own memory did not fit: undo the device as libcuda would */
        if (g_ctx_count[p] == 0) {
            rm_free(g_hroot, device_handle(p));
            device_forget_locked(p);
        }
        pthread_mutex_unlock(&g_lock);
        free(c);
        return r;
    }
    g_ctx_count[p]++;
    __atomic_fetch_or(&g_sim.hdr->procs[slot].context_mask, 1u << p, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_lock);
    c->ordinal = d;
    c->phys = p;
    *pctx = c;
    t_ctx = c;
    return CUDA_SUCCESS;
}

static int contexts_left_locked(void)
{
    int n = 0;
    for (int i = 0; i < SIM_MAX_DEVICES; i++)
        n += g_ctx_count[i];
    return n;
}

/*
 * The last context on a device frees the device object (RM frees its subdevice, VA
 * space, context memory and every allocation under it). The last context of the process
 * ends the client as GPUWATCH_SIM_CTX_TEARDOWN says: free-device (the client stays,
 * empty), free-client (RM_FREE of the client with its last device still allocated: RM
 * frees everything under it) or close-fd (nvidiactl is closed with everything still
 * allocated: RM frees the client on close). A process that exits frees everything too.
 */
API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    int phys = ctx->phys;
    pthread_mutex_lock(&g_lock);
    if (phys < 0 || phys >= SIM_MAX_DEVICES || g_ctx_count[phys] <= 0) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (--g_ctx_count[phys] == 0) {
        int last = contexts_left_locked() == 0;
        if (last && g_cfg.teardown == TEARDOWN_CLOSE_FD) {
            if (g_ctl_fd >= 0)
                close(g_ctl_fd);
            g_ctl_fd = -1;
            g_client_allocated = 0;
            for (int i = 0; i < SIM_MAX_DEVICES; i++)
                if (g_devices_allocated & (1u << i))
                    device_forget_locked(i);
        } else if (last && g_cfg.teardown == TEARDOWN_FREE_CLIENT) {
            rm_free(g_hroot, g_hroot);
            g_client_allocated = 0;
            for (int i = 0; i < SIM_MAX_DEVICES; i++)
                if (g_devices_allocated & (1u << i))
                    device_forget_locked(i);
        } else {
            rm_free(g_hroot, device_handle(phys));
            device_forget_locked(phys);
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (t_ctx == ctx)
        t_ctx = NULL;
    free(ctx);
    return CUDA_SUCCESS;
}

/* ---- allocations ---- */

static CUdeviceptr next_fake_va(uint64_t bytes)
{
    CUdeviceptr p = g_next_va;
    g_next_va += round_up(bytes, 2u << 20) + (2u << 20);
    return p;
}

/* cuMemAlloc through the driver: its own memory object, or carved from a chunk when below
 * GPUWATCH_SIM_SUBALLOC_MIB (default 2, as real CUDA; a chunk is allocated when none has
 * room, freed when empty; a counting allocator: no fragmentation is modelled). g_lock held. */
static CUresult alloc_driver_locked(int phys, uint64_t bytes, struct alloc_rec *rec)
{
    CUresult err = CUDA_SUCCESS;
    rec->phys = phys;
    rec->size = bytes;
    struct ledger_delta mine = {0}; /* the cuMemAlloc's own counts */
    mine.requested_bytes = (int64_t)bytes;
    mine.allocations = 1;
    if (g_cfg.suballoc_bytes && bytes < g_cfg.suballoc_bytes) {
        uint64_t carve = round_up(bytes, CARVE_ALIGN_BYTES);
        struct rm_mem *chunk = NULL;
        for (size_t i = 0; i < g_mem_count && !chunk; i++)
            if (g_mem[i].kind == MEM_CHUNK && g_mem[i].phys == phys && g_mem[i].size - g_mem[i].carved >= carve)
                chunk = &g_mem[i];
        if (!chunk) {
            uint32_t h = mem_create(phys, MEM_CHUNK, g_cfg.suballoc_bytes, &mine, &err);
            if (!h)
                return err;
            chunk = mem_find(h);
        } else {
            ledger_apply(phys, &mine, 0);
        }
        chunk->carved += carve;
        chunk->users++;
        rec->kind = REC_CARVED;
        rec->handle = chunk->handle;
        rec->charged = carve;
    } else {
        uint32_t h = mem_create(phys, MEM_DIRECT, bytes, &mine, &err);
        if (!h)
            return err;
        rec->kind = REC_DIRECT;
        rec->handle = h;
        rec->charged = 0;
    }
    rec->ptr = next_fake_va(bytes);
    return CUDA_SUCCESS;
}

/* cuMemAllocManaged: no RM object. nvidia-uvm is initialised once (UVM_INITIALIZE) and
 * the range is an mmap of the uvm fd. NVML's per-process number does not count it (the
 * H100 recording: 518 MiB before, with and after a 64 MiB managed range) and the device's
 * room is not checked (managed memory oversubscribes); the ledger keeps its length, in
 * UVM's 2 MiB chunks, as managed_bytes (diagnostics). g_lock held. */
static CUresult alloc_managed_locked(int phys, uint64_t bytes, struct alloc_rec *rec)
{
    if (g_uvm_fd < 0)
        return CUDA_ERROR_UNKNOWN;
    if (!g_uvm_initialized) {
        UVM_INITIALIZE_PARAMS ip;
        memset(&ip, 0, sizeof(ip));
        ip.rmStatus = NV_OK;
        (void)ioctl(g_uvm_fd, UVM_INITIALIZE, &ip);
        g_uvm_initialized = 1;
    }
    uint64_t len = round_up(bytes, UVM_CHUNK_BYTES);
    struct ledger_delta d = {0};
    d.managed_bytes = (int64_t)len;
    d.requested_bytes = (int64_t)bytes;
    d.allocations = 1;
    int rc = ledger_apply(phys, &d, 1);
    if (rc < 0)
        return rc == -1 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN;
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, g_uvm_fd, 0);
    if (m == MAP_FAILED) {
        struct ledger_delta undo = {0, 0, 0, -(int64_t)len, -(int64_t)bytes, -1};
        ledger_apply(phys, &undo, 0);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    rec->ptr = (CUdeviceptr)(uintptr_t)m;
    rec->size = bytes;
    rec->charged = len;
    rec->handle = 0;
    rec->phys = phys;
    rec->kind = REC_MANAGED;
    return CUDA_SUCCESS;
}

static CUresult do_alloc(CUdeviceptr *dptr, size_t bytes, int managed)
{
    if (!t_ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    int phys = t_ctx->phys;
    if (g_sim.hdr->devices[phys].lost)
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    pthread_mutex_lock(&g_lock);
    if (ensure_slot() < 0 || !(g_devices_allocated & (1u << phys))) {
        pthread_mutex_unlock(&g_lock);
        return ensure_slot() < 0 ? CUDA_ERROR_UNKNOWN : CUDA_ERROR_INVALID_CONTEXT;
    }
    struct alloc_rec rec;
    memset(&rec, 0, sizeof(rec));
    CUresult r = managed ? alloc_managed_locked(phys, bytes, &rec) : alloc_driver_locked(phys, bytes, &rec);
    if (r == CUDA_SUCCESS && allocs_put(rec) < 0) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY; /* process-local table: practically never */
    }
    pthread_mutex_unlock(&g_lock);
    if (r == CUDA_SUCCESS)
        *dptr = rec.ptr;
    return r;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
{
    return do_alloc(dptr, bytes, 0);
}

API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags)
{
    (void)flags;
    return do_alloc(dptr, bytes, 1);
}


static int pool_destroyed(const struct rm_mem *m);

API CUresult cuMemFree_v2(CUdeviceptr ptr)
{
    if (ptr == 0)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    struct alloc_rec rec;
    if (g_slot < 0 || allocs_take(ptr, &rec) < 0) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    g_alloc_used--;
    struct ledger_delta d = {0};
    d.requested_bytes = -(int64_t)rec.size;
    struct rm_mem *m = rec.kind == REC_MANAGED ? NULL : mem_find(rec.handle);
    if (rec.kind == REC_MANAGED) {
        munmap((void *)(uintptr_t)rec.ptr, rec.charged);
        d.managed_bytes = -(int64_t)rec.charged;
    } else if (m && (rec.kind == REC_CARVED || rec.kind == REC_POOL)) {
        m->carved -= rec.charged;
        m->users--;
    }
    /* a pool keeps its memory until it is trimmed (a synchronize, cuMemPoolTrimTo) or
     * destroyed; a chunk goes with its last user */
    int keep = rec.kind == REC_POOL && !pool_destroyed(m);
    if (m && !keep && (rec.kind == REC_DIRECT || m->users == 0))
        mem_destroy(m, &d); /* the object and this cuMemFree's counts in one step */
    else
        ledger_apply(rec.phys, &d, 0);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

API CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream s)
{
    (void)s;
    return cuMemFree_v2(ptr); /* a pool allocation goes back to its pool */
}

/* ---- stream-ordered pools (cuMemAllocAsync, cuMemPool*) ----
 *
 * As recorded on the H100: the default pool's first 32 MiB allocation issued RM_ALLOC of a
 * class-0x3E object (system memory, never in NVML's number) and of a class-0x40 one (NVML
 * +32 MiB); cuMemFreeAsync + cuStreamSynchronize freed the 0x40 object (the pool's release
 * threshold is 0); a created pool's 16 MiB allocation issued one RM_ALLOC 0x40 (NVML
 * +32 MiB: pools reserve 32 MiB objects) and cuMemPoolDestroy freed it. So: the first pool
 * allocation of a process on a GPU adds one 0x3E object (it goes with the device); pool
 * allocations of up to 32 MiB are carved from 32 MiB 0x40 objects, larger ones get an
 * object of their own (RM's rounding); freed allocations stay in the pool until a
 * synchronize trims it to its release threshold (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
 * default 0), cuMemPoolTrimTo, or cuMemPoolDestroy. Freeing an object is an RM_FREE. */

#define NV01_MEMORY_SYSTEM 0x3E
#define NVOS32_ATTR_LOCATION_PCI 1u /* attr bits 26:25: system memory */
#define POOL_SYSMEM_BYTES (2ULL << 20)
enum { CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5,
       CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7 };
enum { CU_MEM_LOCATION_TYPE_DEVICE = 1, CU_MEM_ALLOCATION_TYPE_PINNED = 1 };

typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE */
    int id;
} CUmemLocation;

typedef struct {
    int allocType;             /* CU_MEM_ALLOCATION_TYPE_PINNED */
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    unsigned char rest[64];    /* maxSize, usage, reserved */
} CUmemPoolProps;              /* 88 B */

typedef struct {
    int type;                  /* CU_MEM_ALLOCATION_TYPE_PINNED */
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;         /* 32 B */

typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps is 88 bytes");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes");

struct sim_pool {
    int phys;
    int is_default;
    int destroyed;
    uint64_t release_threshold;
};
typedef struct sim_pool *CUmemoryPool;

static struct sim_pool g_default_pool[SIM_MAX_DEVICES];

static int pool_destroyed(const struct rm_mem *m)
{
    return m && m->pool && m->pool->destroyed;
}

static uint64_t pool_bytes(const struct sim_pool *pool, int used)
{
    uint64_t n = 0;
    for (size_t i = 0; i < g_mem_count; i++)
        if (g_mem[i].kind == MEM_POOL && g_mem[i].pool == pool)
            n += used ? g_mem[i].carved : g_mem[i].size;
    return n;
}

/* Free the pool's unused objects while it holds more than `keep` bytes. g_lock held. */
static void pool_trim_locked(struct sim_pool *pool, uint64_t keep)
{
    uint64_t reserved = pool_bytes(pool, 0);
    for (size_t i = 0; i < g_mem_count && reserved > keep;) {
        struct rm_mem *m = &g_mem[i];
        if (m->kind == MEM_POOL && m->pool == pool && m->users == 0) {
            reserved -= m->size;
            mem_destroy(m, NULL); /* moves the last object to i */
            continue;
        }
        i++;
    }
}

static void pools_synchronized(int phys)
{
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_mem_count;) {
        struct rm_mem *m = &g_mem[i];
        if (m->kind == MEM_POOL && m->phys == phys && m->users == 0 &&
            pool_bytes(m->pool, 0) > m->pool->release_threshold) {
            mem_destroy(m, NULL);
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&g_lock);
}

/* the class-0x3E object of a process's first pool allocation on `phys` (not charged: system
 * memory; it goes with the device). g_lock held. */
static void pool_sysmem_locked(int phys)
{
    if (g_pool_sysmem & (1u << phys))
        return;
    NV_MEMORY_ALLOCATION_PARAMS mp;
    memset(&mp, 0, sizeof(mp));
    mp.owner = g_hroot;
    mp.type = NVOS32_TYPE_IMAGE;
    mp.attr = NVOS32_ATTR_LOCATION_PCI << 25;
    mp.size = POOL_SYSMEM_BYTES;
    mp.limit = POOL_SYSMEM_BYTES - 1;
    rm_alloc(g_hroot, device_handle(phys), g_next_handle++, NV01_MEMORY_SYSTEM, &mp, sizeof(mp), NV_OK);
    g_pool_sysmem |= 1u << phys;
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t bytes, struct sim_pool *pool)
{
    if (!dptr || bytes == 0 || !pool || pool->destroyed)
        return CUDA_ERROR_INVALID_VALUE;
    int phys = pool->phys;
    if (g_sim.hdr->devices[phys].lost)
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    pthread_mutex_lock(&g_lock);
    if (ensure_slot() < 0 || !(g_devices_allocated & (1u << phys))) {
        pthread_mutex_unlock(&g_lock);
        return g_slot < 0 ? CUDA_ERROR_UNKNOWN : CUDA_ERROR_INVALID_CONTEXT;
    }
    pool_sysmem_locked(phys);
    struct ledger_delta mine = {0};
    mine.requested_bytes = (int64_t)bytes;
    mine.allocations = 1;
    uint64_t carve = round_up(bytes, CARVE_ALIGN_BYTES);
    struct rm_mem *obj = NULL;
    for (size_t i = 0; i < g_mem_count && !obj; i++)
        if (g_mem[i].kind == MEM_POOL && g_mem[i].pool == pool && g_mem[i].size - g_mem[i].carved >= carve)
            obj = &g_mem[i];
    CUresult err = CUDA_SUCCESS;
    if (!obj) {
        uint64_t size = bytes <= POOL_CHUNK_BYTES ? POOL_CHUNK_BYTES : bytes;
        uint32_t h = mem_create(phys, MEM_POOL, size, &mine, &err);
        if (!h) {
            pthread_mutex_unlock(&g_lock);
            return err;
        }
        obj = mem_find(h);
        obj->pool = pool;
    } else {
        ledger_apply(phys, &mine, 0);
    }
    obj->carved += carve;
    obj->users++;
    struct alloc_rec rec;
    memset(&rec, 0, sizeof(rec));
    rec.ptr = next_fake_va(bytes);
    rec.size = bytes;
    rec.charged = carve;
    rec.handle = obj->handle;
    rec.phys = phys;
    rec.kind = REC_POOL;
    if (allocs_put(rec) < 0) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&g_lock);
    *dptr = rec.ptr;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d)
{
    CUresult r = ensure_init();
    if (r)
        return r;
    int p = phys_of(d);
    if (p < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    g_default_pool[p].phys = p;
    g_default_pool[p].is_default = 1;
    *pool = &g_default_pool[p];
    return CUDA_SUCCESS;
}

API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    CUresult r = ensure_init();
    if (r)
        return r;
    if (!pool || !props || props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    int p = phys_of(props->location.id);
    if (p < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    struct sim_pool *np = calloc(1, sizeof(*np));
    if (!np)
        return CUDA_ERROR_OUT_OF_MEMORY;
    np->phys = p;
    *pool = np;
    return CUDA_SUCCESS;
}

/* Frees the pool's unused memory at once; objects still in use go with their last free. */
API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    if (!pool || pool->is_default || pool->destroyed)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    pool->destroyed = 1;
    pool_trim_locked(pool, 0);
    int empty = pool_bytes(pool, 0) == 0;
    pthread_mutex_unlock(&g_lock);
    if (empty)
        free(pool);
    return CUDA_SUCCESS;
}

API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep_bytes)
{
    if (!pool || pool->destroyed)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    pool_trim_locked(pool, keep_bytes);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    if (!pool || pool->destroyed || !value)
        return CUDA_ERROR_INVALID_VALUE;
    if (attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        return CUDA_ERROR_NOT_SUPPORTED;
    pool->release_threshold = *(const uint64_t *)value;
    return CUDA_SUCCESS;
}

API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
    if (!pool || pool->destroyed || !value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    uint64_t v;
    if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        v = pool->release_threshold;
    else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        v = pool_bytes(pool, 0);
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        v = pool_bytes(pool, 1);
    else {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    pthread_mutex_unlock(&g_lock);
    *(uint64_t *)value = v;
    return CUDA_SUCCESS;
}

API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s)
{
    (void)s;
    return pool_alloc(dptr, bytes, pool);
}

/* from the current device's default pool, as real CUDA does */
API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s)
{
    (void)s;
    if (!t_ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUmemoryPool pool = NULL;
    CUresult r = cuDeviceGetDefaultMemPool(&pool, t_ctx->ordinal);
    return r ? r : pool_alloc(dptr, bytes, pool);
}

/* ---- virtual memory management (cuMemCreate, cuMemMap, ...) ----
 *
 * As recorded on the H100: cuMemCreate of 32 MiB issued RM_ALLOC of a class-0x40 object
 * (NVML +32 MiB at creation); cuMemAddressReserve, cuMemMap and cuMemSetAccess no RM
 * allocation (mapping is nvidia-uvm's, not issued here); cuMemRelease after cuMemUnmap an
 * RM_FREE. The physical memory lives until it is released and unmapped. The granularity is
 * 2 MiB (the H100's minimum); sizes must be multiples of it. */


typedef unsigned long long CUmemGenericAllocationHandle;

API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option)
{
    (void)option;
    if (!granularity || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = VMM_GRANULARITY_BYTES;
    return CUDA_SUCCESS;
}

API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                         unsigned long long flags)
{
    (void)flags;
    CUresult r = ensure_init();
    if (r)
        return r;
    if (!handle || !prop || size == 0 || size % VMM_GRANULARITY_BYTES || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    int phys = phys_of(prop->location.id);
    if (phys < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (g_sim.hdr->devices[phys].lost)
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    pthread_mutex_lock(&g_lock);
    if (ensure_slot() < 0 || !(g_devices_allocated & (1u << phys))) {
        pthread_mutex_unlock(&g_lock);
        return g_slot < 0 ? CUDA_ERROR_UNKNOWN : CUDA_ERROR_INVALID_CONTEXT;
    }
    struct ledger_delta mine = {0};
    mine.requested_bytes = (int64_t)size;
    mine.allocations = 1;
    CUresult err = CUDA_SUCCESS;
    uint32_t h = mem_create(phys, MEM_VMM, size, &mine, &err);
    pthread_mutex_unlock(&g_lock);
    if (!h)
        return err;
    *handle = h;
    return CUDA_SUCCESS;
}

/* free a VMM object once it is released and unmapped (g_lock held) */
static void vmm_maybe_free_locked(struct rm_mem *m)
{
    if (m->released && m->users == 0) {
        struct ledger_delta d = {0};
        d.requested_bytes = -(int64_t)m->size;
        mem_destroy(m, &d);
    }
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    pthread_mutex_lock(&g_lock);
    struct rm_mem *m = handle >> 32 ? NULL : mem_find((uint32_t)handle);
    if (!m || m->kind != MEM_VMM || m->released) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    m->released = 1;
    vmm_maybe_free_locked(m);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                 unsigned long long flags)
{
    (void)alignment; (void)addr; (void)flags;
    if (!ptr || size == 0 || size % VMM_GRANULARITY_BYTES)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    *ptr = next_fake_va(size);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    return ptr && size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                      unsigned long long flags)
{
    (void)flags;
    if (!ptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct rm_mem *m = handle >> 32 ? NULL : mem_find((uint32_t)handle);
    if (!m || m->kind != MEM_VMM || m->released || offset + size > m->size) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (g_map_count == g_map_cap) {
        size_t cap = g_map_cap ? g_map_cap * 2 : 16;
        struct vmm_map *n = realloc(g_maps, cap * sizeof(*n));
        if (!n) {
            pthread_mutex_unlock(&g_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g_maps = n;
        g_map_cap = cap;
    }
    g_maps[g_map_count].va = ptr;
    g_maps[g_map_count].handle = m->handle;
    g_map_count++;
    m->users++;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    (void)size;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_map_count; i++) {
        if (g_maps[i].va != ptr)
            continue;
        struct rm_mem *m = mem_find(g_maps[i].handle); /* NULL: gone with its device */
        g_maps[i] = g_maps[--g_map_count];
        if (m && m->kind == MEM_VMM) {
            m->users--;
            vmm_maybe_free_locked(m);
        }
        pthread_mutex_unlock(&g_lock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    return ptr && size && desc && count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    if (!t_ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!free_bytes || !total_bytes)
        return CUDA_ERROR_INVALID_VALUE;
    int phys = t_ctx->phys;
    uint64_t total = g_sim.hdr->devices[phys].memory_total_bytes;
    sim_lock(&g_sim, 0);
    uint64_t used = sim_device_used_bytes(&g_sim, phys, &g_self, 0);
    sim_unlock(&g_sim);
    *total_bytes = total;
    *free_bytes = used >= total ? 0 : total - used;
    return CUDA_SUCCESS;
}

/* ---- kernels ---- */

static uint64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* add busy microseconds to the bucket of the current wall time (lock-free) */
static void credit_busy(struct sim_proc *p, int phys, uint64_t busy_ns, uint64_t now_ns)
{
    uint64_t epoch = now_ns / SIM_BUCKET_NS;
    sim_bucket_t *b = &p->buckets[phys][epoch % SIM_BUCKETS];
    uint32_t add_us = (uint32_t)((busy_ns + 500) / 1000);
    sim_bucket_t old = __atomic_load_n(b, __ATOMIC_RELAXED), nw;
    do {
        uint32_t busy = ((uint32_t)(old >> 32) == (uint32_t)epoch) ? (uint32_t)old : 0;
        nw = ((uint64_t)(uint32_t)epoch << 32) | (uint64_t)(busy + add_us);
    } while (!__atomic_compare_exchange_n(b, &old, nw, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    __atomic_fetch_add(&p->busy_ns_total[phys], busy_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&p->last_busy_epoch, (uint32_t)epoch, __ATOMIC_RELAXED);
    sim_credit_sample(p, phys, add_us, now_ns, sim_sample_period_ns(g_sim.hdr)); /* NVML's sample ring */
}

static volatile uint64_t g_sink;

/* run-queue wait of the calling thread (ns), from /proc/thread-self/schedstat field 2 */
static uint64_t run_delay_ns(int fd)
{
    char buf[128];
    if (fd < 0)
        return 0;
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strchr(buf, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* ---- execution engine (layout and rules: simstate.h) ---- */

struct engine_hold {
    struct sim_engine *e;
    int lane;
    uint64_t word; /* the lane word as this thread last wrote it */
};

/* runnable time of the calling thread, split as the kernel loop measures it */
struct runnable {
    uint64_t cpu_ns;
    uint64_t delay_ns;
};

static void futex_wait(uint32_t *addr, uint32_t val, uint64_t timeout_ns)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(timeout_ns / 1000000000ULL);
    ts.tv_nsec = (long)(timeout_ns % 1000000000ULL);
    /* shared (not FUTEX_PRIVATE): waiters and wakers are different processes mapping
     * the same file; EINTR, EAGAIN and ETIMEDOUT all mean "look again" */
    (void)syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(uint32_t *addr)
{
    (void)syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static unsigned engine_lanes(const struct sim_engine *e)
{
    unsigned n = __atomic_load_n(&e->lanes, __ATOMIC_RELAXED);
    return n < 1 ? 1 : n > SIM_MAX_LANES ? SIM_MAX_LANES : n;
}

static uint32_t scan_limit(void)
{
    uint32_t hw = __atomic_load_n(&g_sim.hdr->proc_high_water, __ATOMIC_ACQUIRE);
    return hw > SIM_MAX_PROCS ? SIM_MAX_PROCS : hw;
}

static int waiter_fresh(const struct sim_engine *e, uint32_t s, uint64_t now_ns)
{
    uint64_t seen = __atomic_load_n(&e->wait_seen_ns[s], __ATOMIC_SEQ_CST);
    return !(now_ns > seen && now_ns - seen > SIM_WAITER_STALE_NS);
}

/* 1 when a lane word names slot s: it holds a lane, or was handed one and has not woken
 * up yet -- either way it is no longer in line for another */
static int names_slot(const struct sim_engine *e, uint32_t s)
{
    unsigned lanes = engine_lanes(e);
    for (unsigned l = 0; l < lanes; l++)
        if (sim_engine_word_slot(__atomic_load_n(&e->lane[l], __ATOMIC_SEQ_CST)) == (int)s)
            return 1;
    return 0;
}

/* live waiters in line with a ticket below `ticket`, the caller's slot excluded */
static unsigned waiters_ahead(const struct sim_engine *e, uint64_t ticket, int self, uint64_t now_ns)
{
    unsigned n = 0;
    uint32_t limit = scan_limit();
    for (uint32_t s = 0; s < limit; s++) {
        uint64_t t = __atomic_load_n(&e->wait_ticket[s], __ATOMIC_SEQ_CST);
        if (!t || (int)s == self || t >= ticket)
            continue;
        if (waiter_fresh(e, s, now_ns) && !names_slot(e, s))
            n++;
    }
    return n;
}

/* the live waiter first in line (lowest ticket), the caller's slot excluded; -1: none */
static int first_waiter(const struct sim_engine *e, int self, uint64_t now_ns)
{
    int best = -1;
    uint64_t best_ticket = UINT64_MAX;
    uint32_t limit = scan_limit();
    for (uint32_t s = 0; s < limit; s++) {
        uint64_t t = __atomic_load_n(&e->wait_ticket[s], __ATOMIC_SEQ_CST);
        if (t && (int)s != self && t < best_ticket && waiter_fresh(e, s, now_ns) && !names_slot(e, s)) {
            best = (int)s;
            best_ticket = t;
        }
    }
    return best;
}

static void wake_waiter(struct sim_engine *e, int s)
{
    __atomic_add_fetch(&e->wait_wake[s], 1, __ATOMIC_SEQ_CST);
    futex_wake(&e->wait_wake[s]);
}

static void read_runnable(int sfd, struct runnable *r)
{
    r->cpu_ns = thread_cpu_ns();
    r->delay_ns = run_delay_ns(sfd);
}

/*
 * Wait for a lane of device `phys`. Waiters are served in ticket order among the live
 * ones: the first in line either is handed a lane by its holder (a time-slice end or a
 * kernel end: the lane word already names this slot when it wakes up) or takes a free
 * one -- free meaning 0, or a holder that stopped renewing it (frozen, stopped, dead).
 * Returns 0 holding a lane, -1 when the device was lost meanwhile. The time spent here is
 * recorded as engine wait. `*head_ns` is the runnable time since a hand-off that counts as
 * kernel time already (the wake-up latency: the engine was this thread's from the
 * hand-off on), and `start` where the caller's runnable-time measurement starts.
 */
static int engine_acquire(struct engine_hold *hd, int phys, int slot, int sfd, struct runnable *start,
                          uint64_t *head_ns)
{
    struct sim_header *h = g_sim.hdr;
    struct sim_engine *e = &h->engines[phys];
    uint64_t begin = sim_monotonic_ns();
    uint64_t ticket = __atomic_add_fetch(&e->next_ticket, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&e->wait_seen_ns[slot], begin, __ATOMIC_SEQ_CST);
    __atomic_store_n(&e->wait_ticket[slot], ticket, __ATOMIC_SEQ_CST);
    struct runnable before; /* runnable time when this thread last went to sleep */
    read_runnable(sfd, &before);
    *head_ns = 0;
    int rc = -1;
    uint64_t stale_us = sim_engine_stale_us(h);
    while (!__atomic_load_n(&h->devices[phys].lost, __ATOMIC_ACQUIRE)) {
        uint32_t seq = __atomic_load_n(&e->wait_wake[slot], __ATOMIC_SEQ_CST);
        uint64_t now = sim_monotonic_ns(), now_us = now / 1000ULL;
        __atomic_store_n(&e->wait_seen_ns[slot], now, __ATOMIC_SEQ_CST);
        unsigned lanes = engine_lanes(e), nfree = 0;
        uint64_t first_stale_us = UINT64_MAX; /* when the first held lane goes stale */
        for (unsigned l = 0; l < lanes && rc < 0; l++) {
            uint64_t w = __atomic_load_n(&e->lane[l], __ATOMIC_SEQ_CST);
            if (sim_engine_word_slot(w) != slot || !w) {
                int stale = sim_engine_word_stale(w, now_us, stale_us);
                nfree += (unsigned)stale;
                if (!stale && sim_engine_word_us(w) + stale_us < first_stale_us)
                    first_stale_us = sim_engine_word_us(w) + stale_us;
                continue;
            }
            /* handed to this slot: confirm with a renewal (it may have gone stale and been
             * taken by another waiter meanwhile) */
            uint64_t mine = sim_engine_word(now_us, slot);
            if (__atomic_compare_exchange_n(&e->lane[l], &w, mine, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                hd->e = e;
                hd->lane = (int)l;
                hd->word = mine;
                read_runnable(sfd, start);
                uint64_t ran = (start->cpu_ns - before.cpu_ns) +
                               (start->delay_ns >= before.delay_ns ? start->delay_ns - before.delay_ns : 0);
                uint64_t handed_us = sim_engine_word_us(w);
                uint64_t since = now_us > handed_us ? (now_us - handed_us) * 1000ULL : 0;
                *head_ns = ran < since ? ran : since; /* never before the hand-off */
                rc = 0;
            }
        }
        if (rc == 0)
            break;
        unsigned ahead = waiters_ahead(e, ticket, slot, now);
        if (ahead < nfree) {
            for (unsigned l = 0; l < lanes && rc < 0; l++) {
                uint64_t w = __atomic_load_n(&e->lane[l], __ATOMIC_SEQ_CST);
                if (!sim_engine_word_stale(w, now_us, stale_us))
                    continue;
                uint64_t mine = sim_engine_word(now_us, slot);
                uint64_t seen = w;
                if (__atomic_compare_exchange_n(&e->lane[l], &w, mine, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                    hd->e = e;
                    hd->lane = (int)l;
                    hd->word = mine;
                    __atomic_add_fetch(&e->acquisitions, 1, __ATOMIC_RELAXED);
                    if (seen) {
                        __atomic_add_fetch(&e->steals, 1, __ATOMIC_RELAXED);
                        /* a waiter that was handed the lane and never took it up (frozen in
                         * its wait) is not handed it again until it shows it runs: its next
                         * wake-up refreshes wait_seen_ns */
                        int silent = sim_engine_word_slot(seen);
                        if (silent >= 0 && silent < SIM_MAX_PROCS && silent != slot &&
                            __atomic_load_n(&e->wait_ticket[silent], __ATOMIC_SEQ_CST))
                            __atomic_store_n(&e->wait_seen_ns[silent], 0, __ATOMIC_SEQ_CST);
                    }
                    read_runnable(sfd, start);
                    rc = 0;
                }
            }
            if (rc == 0)
                break;
            continue; /* lost a race for the lane: look again at once */
        }
        /* asleep until a hand-off wakes us or the poll interval passes: the first in line
         * polls fast, and wakes when a held lane's word would go stale if that is sooner, to
         * notice a holder that stopped renewing its lane as soon as it may take it */
        uint64_t poll_ns = ahead == 0 ? SIM_FIRST_WAITER_POLL_NS : SIM_WAITER_POLL_NS;
        if (ahead == 0 && first_stale_us != UINT64_MAX) {
            uint64_t until_ns = (first_stale_us + 1 > now_us ? first_stale_us + 1 - now_us : 0) * 1000ULL;
            if (until_ns < 100000ULL)
                until_ns = 100000ULL;
            if (until_ns < poll_ns)
                poll_ns = until_ns;
        }
        read_runnable(sfd, &before);
        futex_wait(&e->wait_wake[slot], seq, poll_ns);
    }
    __atomic_store_n(&e->wait_ticket[slot], 0, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&h->procs[slot].engine_wait_ns_total[phys], sim_monotonic_ns() - begin, __ATOMIC_RELAXED);
    return rc;
}

/* Prove the holder is running: 1 while it still holds its lane, 0 when the lane was taken
 * from it (it had stopped renewing it: frozen, stopped, starved of CPU). */
static int engine_renew(struct engine_hold *hd, int slot)
{
    uint64_t fresh = sim_engine_word(sim_monotonic_ns() / 1000ULL, slot);
    if (fresh == hd->word)
        return 1;
    uint64_t expected = hd->word;
    if (!__atomic_compare_exchange_n(&hd->e->lane[hd->lane], &expected, fresh, 0, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST))
        return 0;
    hd->word = fresh;
    return 1;
}

/* Give the lane to the first live waiter: the lane word names it (with the hand-off time)
 * before it even wakes up, so the engine is never free in between. Returns 1 when handed
 * over, 0 when nobody waits or the lane is no longer ours. */
static int engine_hand_off(struct engine_hold *hd, int slot)
{
    uint64_t now = sim_monotonic_ns();
    int next = first_waiter(hd->e, slot, now);
    if (next < 0)
        return 0;
    uint64_t expected = hd->word;
    if (!__atomic_compare_exchange_n(&hd->e->lane[hd->lane], &expected, sim_engine_word(now / 1000ULL, next), 0,
                                     __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return 0;
    __atomic_add_fetch(&hd->e->acquisitions, 1, __ATOMIC_RELAXED);
    wake_waiter(hd->e, next);
    /* the waiter after it is first in line now (the lane word names `next`, which is out of
     * the line): wake it, so it watches the lane at the first waiter's pace -- `next` may be
     * frozen and never confirm the hand-off */
    int after = first_waiter(hd->e, slot, now);
    if (after >= 0)
        wake_waiter(hd->e, after);
    return 1;
}

/* At the end of a kernel: hand the lane to the first waiter, or free it. */
static void engine_release(struct engine_hold *hd, int slot)
{
    if (engine_hand_off(hd, slot))
        return;
    uint64_t expected = hd->word;
    if (!__atomic_compare_exchange_n(&hd->e->lane[hd->lane], &expected, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return;
    /* a waiter that arrived after the look for one saw the lane held: wake it */
    int next = first_waiter(hd->e, slot, sim_monotonic_ns());
    if (next >= 0)
        wake_waiter(hd->e, next);
}

/*
 * A kernel of `duration_us` is that much *runnable* time of the calling thread: CPU
 * time (CLOCK_THREAD_CPUTIME_ID) plus time spent waiting on a run queue
 * (schedstat run_delay). So CPU contention on the host does not distort the
 * simulated GPU's utilisation, while a frozen or stopped process -- neither running
 * nor runnable -- accrues nothing. Busy time is credited as it accrues, at the wall
 * time it accrues. On a node whose kernels sleep (header.kernel_host, simstate.h
 * SIM_KERNEL_HOST_SLEEP) the thread sleeps in short steps instead of spinning, and the
 * time asleep counts too, capped per step: the GPU's work then costs no host CPU.
 *
 * The kernel runs only while its thread holds the device's execution engine
 * (simstate.h): it waits (asleep) for it, renews it on every step of the spin, hands it
 * to the first waiter at the end of each time slice (and queues again), and discards a
 * step during which the engine was taken from it. So the busy time of all tenants of a
 * device never adds up to more than the wall time (times the lanes of the MPS-like
 * mode), and co-tenants slow each other down as on a time-sliced GPU.
 */
static CUresult run_kernel(uint64_t duration_us)
{
    if (!t_ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    int phys = t_ctx->phys;
    if (g_sim.hdr->devices[phys].lost)
        return CUDA_ERROR_DEVICE_UNAVAILABLE;
    int slot = ensure_slot();
    if (slot < 0)
        return CUDA_ERROR_UNKNOWN;
    struct sim_proc *p = &g_sim.hdr->procs[slot];
    struct sim_engine *e = &g_sim.hdr->engines[phys];
    __atomic_fetch_add(&p->launches[phys], 1, __ATOMIC_RELAXED);
    if (duration_us == 0)
        return CUDA_SUCCESS; /* an empty kernel needs no engine time */
    pthread_mutex_lock(&g_launch_lock[phys]);
    int sfd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    uint64_t target = duration_us * 1000ULL, done = 0, pending = 0, slice = 0, head = 0;
    uint64_t timeslice = (uint64_t)__atomic_load_n(&e->timeslice_us, __ATOMIC_RELAXED) * 1000ULL;
    if (timeslice == 0)
        timeslice = (uint64_t)SIM_DEFAULT_TIMESLICE_US * 1000ULL;
    struct engine_hold hold;
    struct runnable r0;
    CUresult rc = CUDA_SUCCESS;
    if (engine_acquire(&hold, phys, slot, sfd, &r0, &head) < 0) {
        rc = CUDA_ERROR_DEVICE_UNAVAILABLE;
        goto out;
    }
    uint64_t bucket = sim_realtime_ns() / SIM_BUCKET_NS;
    uint64_t period_ns = sim_sample_period_ns(g_sim.hdr), period = sim_realtime_ns() / period_ns;
    int sleeping = __atomic_load_n(&g_sim.hdr->kernel_host, __ATOMIC_RELAXED) == SIM_KERNEL_HOST_SLEEP;
    while (done < target) {
        uint64_t step_ns = 0, w0 = 0;
        if (sleeping) {
            /* a step of GPU time that costs the host nothing (simstate.h SIM_KERNEL_HOST_SLEEP) */
            step_ns = target - done;
            if (step_ns > SIM_KERNEL_SLEEP_STEP_NS)
                step_ns = SIM_KERNEL_SLEEP_STEP_NS;
            if (slice < timeslice && step_ns > timeslice - slice)
                step_ns = timeslice - slice;
            w0 = sim_monotonic_ns();
            struct timespec ts = {0, (long)step_ns};
            (void)nanosleep(&ts, NULL);
        } else {
            uint64_t x = g_sink;
            for (int i = 0; i < 20000; i++)
                x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            g_sink = x;
        }
        struct runnable r;
        read_runnable(sfd, &r);
        uint64_t ran = (r.cpu_ns - r0.cpu_ns) + (r.delay_ns >= r0.delay_ns ? r.delay_ns - r0.delay_ns : 0);
        uint64_t d = head + ran;
        if (sleeping) {
            /* the time asleep counts, up to the step asked for (+ the timer's slack): a thread
             * frozen or stopped in its sleep was not running on the GPU meanwhile */
            uint64_t wall = sim_monotonic_ns() - w0, asleep = wall > ran ? wall - ran : 0;
            uint64_t cap = step_ns + SIM_KERNEL_SLEEP_SLACK_NS;
            d += asleep < cap ? asleep : cap;
        }
        r0 = r;
        head = 0;
        uint64_t now = sim_realtime_ns();
        if (!engine_renew(&hold, slot)) {
            /* the engine was taken while this thread was not running (frozen, stopped,
             * starved of CPU): the step did not run on the engine, so it is not work --
             * except a sleeping kernel's step as asked for: the lane went stale only
             * SIM_ENGINE_SLEEP_STALE_US after the last renewal, later than the step's end,
             * so the step ran on the engine (as a frozen process's kernel finishes on a
             * real GPU) and the engine idled only after it */
            if (sleeping) {
                uint64_t kept = d < step_ns ? d : step_ns;
                done += kept;
                pending += kept;
            }
            if (done >= target) {
                /* that step finished the kernel: nothing to queue for again */
                if (pending)
                    credit_busy(p, phys, pending, now);
                pending = 0;
                goto out;
            }
            if (pending) {
                credit_busy(p, phys, pending, now);
                pending = 0;
            }
            if (engine_acquire(&hold, phys, slot, sfd, &r0, &head) < 0) {
                rc = CUDA_ERROR_DEVICE_UNAVAILABLE;
                goto out;
            }
            slice = 0;
            continue;
        }
        /* not clipped: a preemption at the end of a kernel lengthens it, as the launch
         * call really took that long while runnable */
        done += d;
        pending += d;
        slice += d;
        /* flush at bucket and NVML sample-period boundaries and at least every ~2 ms of work */
        if (now / SIM_BUCKET_NS != bucket || now / period_ns != period || pending >= 2000000ULL ||
            done >= target) {
            credit_busy(p, phys, pending, now);
            pending = 0;
            bucket = now / SIM_BUCKET_NS;
            period = now / period_ns;
        }
        if (slice >= timeslice && done < target) {
            slice = 0;
            /* end of the time slice: hand the engine to the first waiter, queue again */
            if (pending) {
                credit_busy(p, phys, pending, now);
                pending = 0;
            }
            if (engine_hand_off(&hold, slot)) {
                __atomic_add_fetch(&e->yields, 1, __ATOMIC_RELAXED);
                if (engine_acquire(&hold, phys, slot, sfd, &r0, &head) < 0) {
                    rc = CUDA_ERROR_DEVICE_UNAVAILABLE;
                    goto out;
                }
            }
        }
    }
    engine_release(&hold, slot);
out:
    if (pending)
        credit_busy(p, phys, pending, sim_realtime_ns());
    if (sfd >= 0)
        close(sfd);
    pthread_mutex_unlock(&g_launch_lock[phys]);
    return rc;
}

API CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    (void)m;
    if (!f || !name)
        return CUDA_ERROR_INVALID_VALUE;
    *f = (CUfunction)(uintptr_t)0x5157u; /* any non-NULL handle; duration comes from params */
    return CUDA_SUCCESS;
}

static uint64_t duration_from_params(void **kernelParams)
{
    if (!kernelParams || !kernelParams[0])
        return 0;
    return *(const uint64_t *)kernelParams[0];
}

API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shmem, CUstream s,
                            void **kernelParams, void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem;
    (void)s; (void)extra;
    return run_kernel(duration_from_params(kernelParams));
}

API CUresult cuLaunchKernelEx(const void *config, CUfunction f, void **kernelParams, void **extra)
{
    (void)config; (void)f; (void)extra;
    return run_kernel(duration_from_params(kernelParams));
}

API CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    (void)s;
    return run_kernel((uint64_t)(uintptr_t)g);
}

/* ---- errors and the entry-point table ---- */

API CUresult cuGetErrorName(CUresult e, const char **s)
{
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    switch (e) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_DEVICE_UNAVAILABLE: *s = "CUDA_ERROR_DEVICE_UNAVAILABLE"; break;
    case CUDA_ERROR_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
    default: *s = "CUDA_ERROR_UNKNOWN"; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorString(CUresult e, const char **s)
{
    return cuGetErrorName(e, s);
}

struct proc_entry {
    const char *name;
    void *fn;
};

static const struct proc_entry g_procs[] = {
    {"cuInit", (void *)cuInit},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGet", (void *)cuDeviceGet},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuDeviceGetName", (void *)cuDeviceGetName},
    {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2},
    {"cuDeviceGetUuid", (void *)cuDeviceGetUuid_v2},
    {"cuCtxCreate", (void *)cuCtxCreate_v2},
    {"cuCtxDestroy", (void *)cuCtxDestroy_v2},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent},
    {"cuCtxGetDevice", (void *)cuCtxGetDevice},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize},
    {"cuMemAlloc", (void *)cuMemAlloc_v2},
    {"cuMemAllocManaged", (void *)cuMemAllocManaged},
    {"cuMemAllocAsync", (void *)cuMemAllocAsync},
    {"cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync},
    {"cuDeviceGetDefaultMemPool", (void *)cuDeviceGetDefaultMemPool},
    {"cuMemPoolCreate", (void *)cuMemPoolCreate},
    {"cuMemPoolDestroy", (void *)cuMemPoolDestroy},
    {"cuMemPoolTrimTo", (void *)cuMemPoolTrimTo},
    {"cuMemPoolSetAttribute", (void *)cuMemPoolSetAttribute},
    {"cuMemPoolGetAttribute", (void *)cuMemPoolGetAttribute},
    {"cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity},
    {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemAddressReserve", (void *)cuMemAddressReserve},
    {"cuMemAddressFree", (void *)cuMemAddressFree},
    {"cuMemMap", (void *)cuMemMap},
    {"cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemSetAccess", (void *)cuMemSetAccess},
    {"cuMemFree", (void *)cuMemFree_v2},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync},
    {"cuMemGetInfo", (void *)cuMemGetInfo_v2},
    {"cuModuleGetFunction", (void *)cuModuleGetFunction},
    {"cuLaunchKernel", (void *)cuLaunchKernel},
    {"cuLaunchKernelEx", (void *)cuLaunchKernelEx},
    {"cuGraphLaunch", (void *)cuGraphLaunch},
    {"cuGetErrorName", (void *)cuGetErrorName},
    {"cuGetErrorString", (void *)cuGetErrorString},
};

/* CUdriverProcAddressQueryResult: 0 success, 1 symbol not found */
API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                 unsigned long long flags, int *symbolStatus)
{
    (void)cudaVersion; (void)flags;
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(g_procs) / sizeof(g_procs[0]); i++) {
        if (strcmp(g_procs[i].name, symbol) == 0) {
            *pfn = g_procs[i].fn;
            if (symbolStatus)
                *symbolStatus = 0;
            return CUDA_SUCCESS;
        }
    }
    *pfn = NULL;
    if (symbolStatus)
        *symbolStatus = 1;
    return CUDA_ERROR_NOT_FOUND;
}
