/* Call-cost loops for benchmarks/bench_probes.py.
 *
 *   bench_probes_calls LIB MODE N [PREFIX]      -> prints "<ns per call>"
 *   bench_probes_calls LIB rate MODE PER_SEC SECONDS [PREFIX] -> issues calls at a rate
 * MODE: alloc (cuMemAlloc_v2 + cuMemFree_v2 pair), launch (cuLaunchKernel), ioctl (NVIDIA
 * RM_CONTROL-shaped ioctl on PREFIX"ctl"), ioctl_untracked (same on /dev/null), getppid.
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
    if (!strcmp(mode, "ioctl")) {
        char path[512];
        snprintf(path, sizeof(path), "%sctl", prefix);
        fd = open(path, O_RDWR);
    } else if (!strcmp(mode, "ioctl_untracked")) {
        fd = open("/dev/null", O_RDWR);
    }
    if (mode[0] == 'i' && fd < 0) {
        perror("open");
        exit(2);
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
