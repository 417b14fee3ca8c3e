/* A minimal stand-in for libcuda.so.1 with the entry points the probes attach to (compiled
 * by the tests into tmp). Allocations hand out increasing fake device pointers; a request of
 * more than FAKE_CUDA_CAPACITY bytes returns CUDA_ERROR_OUT_OF_MEMORY (2). */
#include <stddef.h>
#include <stdint.h>

#define FAKE_CUDA_CAPACITY (1ULL << 40)

static volatile uint64_t next_ptr = 0x7f0000000000ULL;
static volatile uint64_t launches;

int cuMemAlloc_v2(uint64_t *dptr, size_t bytes)
{
    if (bytes > FAKE_CUDA_CAPACITY)
        return 2;
    *dptr = next_ptr;
    next_ptr += (bytes + 0xfff) & ~0xfffULL;
    return 0;
}

int cuMemAllocManaged(uint64_t *dptr, size_t bytes, unsigned flags)
{
    (void)flags;
    return cuMemAlloc_v2(dptr, bytes);
}

int cuMemAllocAsync(uint64_t *dptr, size_t bytes, void *stream)
{
    (void)stream;
    return cuMemAlloc_v2(dptr, bytes);
}

int cuMemAllocPitch_v2(uint64_t *dptr, size_t *pitch, size_t width, size_t height, unsigned elem)
{
    (void)elem;
    *pitch = (width + 511) & ~(size_t)511;
    return cuMemAlloc_v2(dptr, *pitch * height);
}

int cuMemCreate(uint64_t *handle, size_t size, const void *prop, unsigned long long flags)
{
    (void)prop; (void)flags;
    return cuMemAlloc_v2(handle, size);
}

int cuMemFree_v2(uint64_t dptr) { return dptr ? 0 : 1; }
int cuMemFreeAsync(uint64_t dptr, void *stream) { (void)stream; return dptr ? 0 : 1; }
int cuMemRelease(uint64_t handle) { return handle ? 0 : 1; }

int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared;
    (void)stream; (void)params; (void)extra;
    launches++;
    return 0;
}

int cuLaunchKernelEx(const void *config, void *f, void **params, void **extra)
{
    (void)config; (void)f; (void)params; (void)extra;
    launches++;
    return 0;
}

int cuGraphLaunch(void *exec, void *stream)
{
    (void)exec; (void)stream;
    launches++;
    return 0;
}
