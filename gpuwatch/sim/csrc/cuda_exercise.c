/*
 * cuda_exercise: drives the CUDA driver API through the allocation paths whose driver
 * traffic gpuwatch's probes must understand, with a named checkpoint after each step.
 *
 * Why: run under the ioctl recorder (ioctl_recorder.c) on a GPU host, it shows what real
 * libcuda asks the NVIDIA driver for (one RM allocation per cuMemAlloc or chunks, which
 * escape, what a context costs); run on the simulated node, it tests the recorder. It
 * needs no CUDA toolkit: libcuda.so.1 is dlopened and the few types are declared here.
 *
 *   cc -O2 -o cuda_exercise cuda_exercise.c -ldl
 *   ./cuda_exercise [--device N] [--libcuda PATH]
 *   ./cuda_exercise --count      (prints "devices N": what a recording script loops over)
 *
 * Every step prints one line: "ok", "skip" (the symbol is missing: the simulated libcuda
 * implements a subset) or "fail" (the call returned an error; later steps that need its
 * result are skipped). Checkpoints call gwrec_checkpoint(name) when the recorder is
 * preloaded and print the same line either way, so the output does not depend on
 * recording. Exit status: 0 all performed steps succeeded, 1 some step failed,
 * 2 no usable device or context (nothing was exercised). The process exits holding the
 * last 256 MiB allocation on purpose (the driver must free it at exit).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUmemoryPool;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

/* CUmemLocation, CUmemAllocationProp, CUmemAccessDesc, CUmemPoolProps (cuda.h layouts) */
typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} mem_location;

typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requested_handle_types; /* 0: none */
    mem_location location;
    void *win32_metadata;
    unsigned char alloc_flags[8];
} mem_allocation_prop; /* 32 B */

typedef struct {
    mem_location location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} mem_access_desc;

typedef struct {
    int alloc_type;   /* PINNED = 1 */
    int handle_types; /* 0 */
    mem_location location;
    void *win32_security_attributes;
    unsigned char rest[64]; /* maxSize, usage, reserved: zero */
} mem_pool_props; /* 88 B */

_Static_assert(sizeof(mem_allocation_prop) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(sizeof(mem_pool_props) == 88, "CUmemPoolProps is 88 bytes");

#define KIB 1024ull
#define MIB (1024ull * KIB)
#define GIB (1024ull * MIB)

static void *g_cuda;
static int g_failures;
static void (*g_checkpoint)(const char *);

static void *sym(const char *name)
{
    return dlsym(g_cuda, name);
}

static const char *error_name(CUresult r)
{
    CUresult (*get)(CUresult, const char **) = (CUresult(*)(CUresult, const char **))sym("cuGetErrorName");
    const char *s = NULL;
    if (get && get(r, &s) == 0 && s)
        return s;
    return "?";
}

static void checkpoint(const char *name)
{
    printf("checkpoint %s\n", name);
    fflush(stdout);
    if (g_checkpoint)
        g_checkpoint(name);
}

/* Report one call: returns 1 when it succeeded. */
static int report(const char *what, CUresult r)
{
    if (r == 0) {
        printf("ok   %s\n", what);
    } else {
        printf("fail %s -> %d %s\n", what, r, error_name(r));
        g_failures++;
    }
    fflush(stdout);
    return r == 0;
}

static void skip(const char *what, const char *why)
{
    printf("skip %s: %s\n", what, why);
    fflush(stdout);
}

/* a libcuda symbol; a missing one is reported as a skipped step */
static void *need(const char *name)
{
    void *p = sym(name);
    if (!p)
        skip(name, "symbol not found");
    return p;
}

#define NEED(var, type, name) __typeof__(type) var = (type)need(name)

/* ---- steps ---- */

static int create_context(CUcontext *ctx, CUdevice dev, const char *label)
{
    char what[128];
    CUresult (*create_v2)(CUcontext *, unsigned, CUdevice) =
        (CUresult(*)(CUcontext *, unsigned, CUdevice))sym("cuCtxCreate_v2");
    if (create_v2) {
        snprintf(what, sizeof(what), "cuCtxCreate_v2(%s, device %d)", label, dev);
        return report(what, create_v2(ctx, 0, dev));
    }
    /* CUDA 13 keeps only the params form */
    CUresult (*create_v4)(CUcontext *, void *, unsigned, CUdevice) =
        (CUresult(*)(CUcontext *, void *, unsigned, CUdevice))sym("cuCtxCreate_v4");
    if (create_v4) {
        snprintf(what, sizeof(what), "cuCtxCreate_v4(%s, device %d)", label, dev);
        return report(what, create_v4(ctx, NULL, 0, dev));
    }
    skip("cuCtxCreate_v2", "symbol not found (nor cuCtxCreate_v4)");
    return 0;
}

static void destroy_context(CUcontext ctx, const char *label)
{
    NEED(destroy, CUresult(*)(CUcontext), "cuCtxDestroy_v2");
    if (destroy) {
        char what[128];
        snprintf(what, sizeof(what), "cuCtxDestroy_v2(%s)", label);
        report(what, destroy(ctx));
    }
}

static const struct {
    const char *label;
    unsigned long long bytes;
} k_sizes[] = {{"1k", KIB}, {"1m", MIB}, {"2m", 2 * MIB}, {"1g", GIB}};
#define N_SIZES (sizeof(k_sizes) / sizeof(k_sizes[0]))

static void step_mem_alloc(void)
{
    NEED(alloc, CUresult(*)(CUdeviceptr *, size_t), "cuMemAlloc_v2");
    NEED(mfree, CUresult(*)(CUdeviceptr), "cuMemFree_v2");
    if (!alloc)
        return;
    CUdeviceptr ptrs[N_SIZES] = {0};
    char what[128], name[64];
    for (size_t i = 0; i < N_SIZES; i++) {
        CUresult r = alloc(&ptrs[i], (size_t)k_sizes[i].bytes);
        snprintf(what, sizeof(what), "cuMemAlloc_v2(%llu) -> 0x%llx", k_sizes[i].bytes, r ? 0ull : ptrs[i]);
        if (!report(what, r))
            ptrs[i] = 0;
        snprintf(name, sizeof(name), "alloc-%s", k_sizes[i].label);
        checkpoint(name);
    }
    if (!mfree)
        return;
    for (size_t i = 0; i < N_SIZES; i++) {
        if (!ptrs[i])
            continue;
        snprintf(what, sizeof(what), "cuMemFree_v2(%s)", k_sizes[i].label);
        report(what, mfree(ptrs[i]));
        snprintf(name, sizeof(name), "free-%s", k_sizes[i].label);
        checkpoint(name);
    }
}

static void step_managed(void)
{
    NEED(alloc, CUresult(*)(CUdeviceptr *, size_t, unsigned), "cuMemAllocManaged");
    if (!alloc)
        return;
    CUdeviceptr p = 0;
    /* CU_MEM_ATTACH_GLOBAL = 1; nothing touches the range */
    int ok = report("cuMemAllocManaged(64 MiB, global)", alloc(&p, (size_t)(64 * MIB), 1));
    checkpoint("managed-64m");
    NEED(mfree, CUresult(*)(CUdeviceptr), "cuMemFree_v2");
    if (mfree && ok) {
        report("cuMemFree_v2(managed)", mfree(p));
        checkpoint("managed-freed");
    }
}

static void step_async(CUdevice dev)
{
    NEED(alloc_async, CUresult(*)(CUdeviceptr *, size_t, CUstream), "cuMemAllocAsync");
    NEED(free_async, CUresult(*)(CUdeviceptr, CUstream), "cuMemFreeAsync");
    NEED(sync, CUresult(*)(CUstream), "cuStreamSynchronize");
    if (!alloc_async || !free_async || !sync)
        return;
    CUresult (*default_pool)(CUmemoryPool *, CUdevice) =
        (CUresult(*)(CUmemoryPool *, CUdevice))sym("cuDeviceGetDefaultMemPool");
    CUresult (*from_pool)(CUdeviceptr *, size_t, CUmemoryPool, CUstream) =
        (CUresult(*)(CUdeviceptr *, size_t, CUmemoryPool, CUstream))sym("cuMemAllocFromPoolAsync");
    CUmemoryPool pool = NULL;
    CUdeviceptr p = 0;
    int ok;
    if (default_pool && from_pool && report("cuDeviceGetDefaultMemPool", default_pool(&pool, dev))) {
        ok = report("cuMemAllocFromPoolAsync(default pool, 32 MiB, null stream)",
                    from_pool(&p, (size_t)(32 * MIB), pool, NULL));
    } else {
        if (!default_pool || !from_pool)
            skip("cuDeviceGetDefaultMemPool/cuMemAllocFromPoolAsync", "symbol not found; using cuMemAllocAsync");
        ok = report("cuMemAllocAsync(32 MiB, null stream)", alloc_async(&p, (size_t)(32 * MIB), NULL));
    }
    report("cuStreamSynchronize", sync(NULL));
    checkpoint("async-32m");
    if (ok) {
        report("cuMemFreeAsync", free_async(p, NULL));
        report("cuStreamSynchronize", sync(NULL));
        checkpoint("async-freed");
    }
}

static void step_pool(CUdevice dev)
{
    NEED(create, CUresult(*)(CUmemoryPool *, const mem_pool_props *), "cuMemPoolCreate");
    NEED(destroy, CUresult(*)(CUmemoryPool), "cuMemPoolDestroy");
    NEED(from_pool, CUresult(*)(CUdeviceptr *, size_t, CUmemoryPool, CUstream), "cuMemAllocFromPoolAsync");
    NEED(free_async, CUresult(*)(CUdeviceptr, CUstream), "cuMemFreeAsync");
    NEED(sync, CUresult(*)(CUstream), "cuStreamSynchronize");
    if (!create || !destroy || !from_pool || !free_async || !sync)
        return;
    mem_pool_props props;
    memset(&props, 0, sizeof(props));
    props.alloc_type = 1;
    props.location.type = 1;
    props.location.id = dev;
    CUmemoryPool pool = NULL;
    if (!report("cuMemPoolCreate(device pool)", create(&pool, &props)))
        return;
    CUdeviceptr p = 0;
    int ok = report("cuMemAllocFromPoolAsync(own pool, 16 MiB)", from_pool(&p, (size_t)(16 * MIB), pool, NULL));
    report("cuStreamSynchronize", sync(NULL));
    checkpoint("pool-16m");
    if (ok) {
        report("cuMemFreeAsync(pool)", free_async(p, NULL));
        report("cuStreamSynchronize", sync(NULL));
    }
    report("cuMemPoolDestroy", destroy(pool));
    checkpoint("pool-destroyed");
}

static void step_vmm(CUdevice dev)
{
    NEED(granularity, CUresult(*)(size_t *, const mem_allocation_prop *, int), "cuMemGetAllocationGranularity");
    NEED(create, CUresult(*)(CUmemGenericAllocationHandle *, size_t, const mem_allocation_prop *,
                             unsigned long long),
         "cuMemCreate");
    NEED(reserve, CUresult(*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long),
         "cuMemAddressReserve");
    NEED(map, CUresult(*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long),
         "cuMemMap");
    NEED(set_access, CUresult(*)(CUdeviceptr, size_t, const mem_access_desc *, size_t), "cuMemSetAccess");
    NEED(unmap, CUresult(*)(CUdeviceptr, size_t), "cuMemUnmap");
    NEED(release, CUresult(*)(CUmemGenericAllocationHandle), "cuMemRelease");
    NEED(address_free, CUresult(*)(CUdeviceptr, size_t), "cuMemAddressFree");
    if (!granularity || !create || !reserve || !map || !set_access || !unmap || !release || !address_free)
        return;
    mem_allocation_prop prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = 1;
    prop.location.type = 1;
    prop.location.id = dev;
    size_t gran = 0;
    char what[160];
    if (!report("cuMemGetAllocationGranularity(minimum)", granularity(&gran, &prop, 0)) || gran == 0)
        return;
    size_t size = ((32 * MIB + gran - 1) / gran) * gran;
    printf("info granularity %zu bytes; VMM size %zu bytes\n", gran, size);
    CUmemGenericAllocationHandle handle = 0;
    snprintf(what, sizeof(what), "cuMemCreate(%zu)", size);
    if (!report(what, create(&handle, size, &prop, 0)))
        return;
    checkpoint("vmm-created");
    CUdeviceptr va = 0;
    if (report("cuMemAddressReserve", reserve(&va, size, 0, 0, 0))) {
        if (report("cuMemMap", map(va, size, 0, handle, 0))) {
            mem_access_desc access = {{1, dev}, 3};
            report("cuMemSetAccess(read-write)", set_access(va, size, &access, 1));
            checkpoint("vmm-mapped");
            report("cuMemUnmap", unmap(va, size));
        }
        report("cuMemAddressFree", address_free(va, size));
    }
    report("cuMemRelease", release(handle));
    checkpoint("vmm-released");
}

/* "devices N" (0 when libcuda or cuInit fails) */
static int print_device_count(const char *lib)
{
    int n = 0;
    g_cuda = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    CUresult (*init)(unsigned) = g_cuda ? (CUresult(*)(unsigned))sym("cuInit") : NULL;
    CUresult (*count)(int *) = g_cuda ? (CUresult(*)(int *))sym("cuDeviceGetCount") : NULL;
    if (!init || !count || init(0) != 0 || count(&n) != 0)
        n = 0;
    printf("devices %d\n", n);
    return n > 0 ? 0 : 2;
}

static int usage(const char *argv0)
{
    fprintf(stderr, "usage: %s [--device N] [--libcuda PATH] [--count]\n", argv0);
    return 2;
}

int main(int argc, char **argv)
{
    int device = 0;
    const char *lib = "libcuda.so.1";
    int count_only = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
            char *end;
            device = (int)strtol(argv[++i], &end, 10);
            if (*end || device < 0)
                return usage(argv[0]);
        } else if (strcmp(argv[i], "--libcuda") == 0 && i + 1 < argc) {
            lib = argv[++i];
        } else if (strcmp(argv[i], "--count") == 0) {
            count_only = 1;
        } else {
            return usage(argv[0]);
        }
    }
    if (count_only)
        return print_device_count(lib);
    g_checkpoint = (void (*)(const char *))dlsym(RTLD_DEFAULT, "gwrec_checkpoint");
    printf("cuda_exercise: device %d, %s, recorder %s\n", device, lib, g_checkpoint ? "present" : "absent");
    g_cuda = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!g_cuda) {
        printf("fail dlopen(%s): %s\n", lib, dlerror());
        return 2;
    }

    NEED(init, CUresult(*)(unsigned), "cuInit");
    if (!init || !report("cuInit(0)", init(0)))
        return 2;
    CUresult (*driver_version)(int *) = (CUresult(*)(int *))sym("cuDriverGetVersion");
    int version = 0;
    if (driver_version && driver_version(&version) == 0)
        printf("info CUDA driver version %d\n", version);
    checkpoint("init");

    NEED(device_get, CUresult(*)(CUdevice *, int), "cuDeviceGet");
    CUdevice dev = 0;
    char what[128];
    snprintf(what, sizeof(what), "cuDeviceGet(%d)", device);
    if (!device_get || !report(what, device_get(&dev, device)))
        return 2;
    CUresult (*device_name)(char *, int, CUdevice) = (CUresult(*)(char *, int, CUdevice))sym("cuDeviceGetName");
    char name[128] = "";
    if (device_name && device_name(name, sizeof(name), dev) == 0)
        printf("info device %d: %s\n", device, name);
    /* the UUID ties this CUDA ordinal to NVML's GPU (the trace header lists NVML's) */
    CUresult (*device_uuid)(unsigned char *, CUdevice) =
        (CUresult(*)(unsigned char *, CUdevice))sym("cuDeviceGetUuid_v2");
    unsigned char u[16];
    if (device_uuid && device_uuid(u, dev) == 0)
        printf("info device %d: GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", device,
               u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);

    CUcontext ctx = NULL;
    if (!create_context(&ctx, dev, "first"))
        return 2;
    checkpoint("context");

    step_mem_alloc();
    step_managed();
    step_async(dev);
    step_pool(dev);
    step_vmm(dev);

    destroy_context(ctx, "first");
    checkpoint("context-destroyed");

    CUcontext second = NULL;
    if (create_context(&second, dev, "second")) {
        checkpoint("second-context");
        NEED(alloc, CUresult(*)(CUdeviceptr *, size_t), "cuMemAlloc_v2");
        if (alloc) {
            CUdeviceptr held = 0;
            report("cuMemAlloc_v2(256 MiB, held until exit)", alloc(&held, (size_t)(256 * MIB)));
            checkpoint("held-256m");
        }
    }
    printf("exit with %s\n", g_failures ? "failures" : "every performed step ok");
    fflush(stdout);
    return g_failures ? 1 : 0;
}
