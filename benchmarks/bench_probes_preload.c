/* An LD_PRELOAD interposer on the libcuda entry points, the cheapest user-space
 * alternative to uprobes (what HAMi-core-style interposers do): count, then forward. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

static unsigned long allocs, frees, launches;

typedef int (*alloc_fn)(uint64_t *, size_t);
typedef int (*free_fn)(uint64_t);
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);

int cuMemAlloc_v2(uint64_t *dptr, size_t bytes)
{
    static alloc_fn real;
    if (!real)
        real = (alloc_fn)dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    __atomic_fetch_add(&allocs, 1, __ATOMIC_RELAXED);
    return real(dptr, bytes);
}

int cuMemFree_v2(uint64_t dptr)
{
    static free_fn real;
    if (!real)
        real = (free_fn)dlsym(RTLD_NEXT, "cuMemFree_v2");
    __atomic_fetch_add(&frees, 1, __ATOMIC_RELAXED);
    return real(dptr);
}

int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra)
{
    static launch_fn real;
    if (!real)
        real = (launch_fn)dlsym(RTLD_NEXT, "cuLaunchKernel");
    __atomic_fetch_add(&launches, 1, __ATOMIC_RELAXED);
    return real(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}
