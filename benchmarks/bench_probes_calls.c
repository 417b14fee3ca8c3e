/* Call-cost loops for benchmarks/bench_probes.py.
 *
 *   bench_probes_calls LIB MODE N [PREFIX]      -> prints "<ns per call>"
 *   bench_probes_calls LIB rate MODE PER_SEC SECONDS [PREFIX] -> issues calls at a rate
 * MODE: alloc (cuMemAlloc_v2 + cuMemFree_v2 pair), launch (cuLaunchKernel), ioctl (NVIDIA
 * RM_CONTROL-shaped ioctl on PREFIX"ctl"), ioctl_untracked (same on /dev/null), rmpair (an
 * RM_ALLOC of video memory, NVOS21 with a 4 KiB NV_MEMORY_ALLOCATION_PARAMS.size, then the
 * RM_FREE of that handle, both on PREFIX"ctl": the decoder's allocation path), rmchain (the
 * same pair under a subdevice of a device of a client allocated once at setup, as libcuda's
 * objects are: the decoder walks the parent chain), getppid.
 * Functions are looked up with RTLD_DEFAULT so an LD_PRELOAD interposer comes first. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int (*alloc_fn)(uint64_t *, size_t);
typedef int (*free_fn)(uint64_t);
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);

static alloc_fn f_alloc;
static free_fn f_free;
static launch_fn f_launch;
static int fd = -1;
static uint64_t buf[4];
static uint64_t memparams[16];  /* NV_MEMORY_ALLOCATION_PARAMS: size @64 */
static struct { uint32_t h_root, h_parent, h_new, h_class; uint64_t p_params; uint32_t params_size, status; } alloc21;
static struct { uint32_t h_root, h_parent, h_old, status; } free00;

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static void one(const char *mode)
{
    if (mode[0] == 'a') {
        uint64_t p = 0;
        f_alloc(&p, 4096);
        f_free(p);
    } else if (mode[0] == 'l') {
        f_launch(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    } else if (mode[0] == 'i') {
        (void)ioctl(fd, _IOC(_IOC_READ | _IOC_WRITE, 'F', 0x2A, sizeof(buf)), buf);
    } else if (mode[0] == 'r') {
        memparams[8] = 4096;
        alloc21.h_root = 0xc1d00001;
        alloc21.h_parent = mode[2] == 'c' ? 0xbeef2080 : 0xc1d00002;
        alloc21.h_new = 0xcafe0001;
        alloc21.h_class = 0x40;
        alloc21.p_params = (uint64_t)(uintptr_t)memparams;
        alloc21.params_size = sizeof(memparams);
        (void)ioctl(fd, _IOC(_IOC_READ | _IOC_WRITE, 'F', 0x2B, sizeof(alloc21)), &alloc21);
        free00.h_root = alloc21.h_root;
        free00.h_parent = alloc21.h_parent;
        free00.h_old = alloc21.h_new;
        (void)ioctl(fd, _IOC(_IOC_READ | _IOC_WRITE, 'F', 0x29, sizeof(free00)), &free00);
    } else {
        (void)syscall(SYS_getppid);
    }
}

static void setup(const char *lib, const char *mode, const char *prefix)
{
    if (!dlopen(lib, RTLD_NOW | RTLD_GLOBAL)) {
        fprintf(stderr, "%s\n", dlerror());
        exit(2);
    }
    f_alloc = (alloc_fn)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    f_free = (free_fn)dlsym(RTLD_DEFAULT, "cuMemFree_v2");
    f_launch = (launch_fn)dlsym(RTLD_DEFAULT, "cuLaunchKernel");
    if (!strcmp(mode, "ioctl") || mode[0] == 'r') {
        char path[512];
        snprintf(path, sizeof(path), "%sctl", prefix);
        fd = open(path, O_RDWR);
    } else if (!strcmp(mode, "ioctl_untracked")) {
        fd = open("/dev/null", O_RDWR);
    }
    if ((mode[0] == 'i' || mode[0] == 'r') && fd < 0) {
        perror("open");
        exit(2);
    }
    if (!strcmp(mode, "rmchain")) {   /* client 0x41, device 0x80, subdevice 0x2080, once */
        static const uint32_t chain[3][4] = {{0, 0, 0xc1d00001, 0x41},
                                             {0xc1d00001, 0xc1d00001, 0xbeef0080, 0x80},
                                             {0xc1d00001, 0xbeef0080, 0xbeef2080, 0x2080}};
        static uint32_t devparams[14];
        for (int k = 0; k < 3; k++) {
            alloc21.h_root = chain[k][0];
            alloc21.h_parent = chain[k][1];
            alloc21.h_new = chain[k][2];
            alloc21.h_class = chain[k][3];
            alloc21.p_params = k == 0 ? 0 : (uint64_t)(uintptr_t)devparams;
            alloc21.params_size = k == 0 ? 0 : sizeof(devparams);
            (void)ioctl(fd, _IOC(_IOC_READ | _IOC_WRITE, 'F', 0x2B, sizeof(alloc21)), &alloc21);
        }
    }
}

int main(int argc, char **argv)
{
    if (argc < 4)
        return 64;
    const char *lib = argv[1];
    if (!strcmp(argv[2], "rate")) {
        const char *mode = argv[3];
        double per_s = atof(argv[4]), secs = atof(argv[5]);
        setup(lib, mode, argc > 6 ? argv[6] : "");
        double start = now_ns(), done = 0;
        while (now_ns() - start < secs * 1e9) {
            double due = (now_ns() - start) / 1e9 * per_s;
            while (done < due) {
                one(mode);
                done++;
            }
            usleep(1000);
        }
        printf("%.0f\n", done);
        return 0;
    }
    const char *mode = argv[2];
    long n = atol(argv[3]);
    setup(lib, mode, argc > 4 ? argv[4] : "");
    for (long k = 0; k < n / 10; k++)  /* warm up */
        one(mode);
    double t0 = now_ns();
    for (long k = 0; k < n; k++)
        one(mode);
    printf("%.1f\n", (now_ns() - t0) / n);
    return 0;
}
