/*
 * simworker: a tiny native GPU workload for the simulated node.
 *
 * It goes through the stub libcuda exactly like a CUDA program would (linked with
 * -lcuda, found via rpath $ORIGIN or LD_LIBRARY_PATH), so probes, NVML and enforcement
 * see it as a GPU process -- at a fraction of the cost of a Python workload, which is
 * what scale tests and benchmarks with hundreds of GPU processes need.
 *
 *   simworker [--gpu N] [--mib-per-step M] [--steps S] [--interval-s T]
 *             [--duty D] [--kernel-ms K] [--lifetime-s L] [--free]
 *
 * It creates a context on device N, allocates M MiB per step S times (T seconds
 * apart), prints "ready <pid> <bytes>" on stdout once all steps are done, then
 * launches kernels of K ms with a duty cycle D (0 = idle) until L seconds have passed
 * (0 = until killed). With --free it frees everything before exiting.
 * Exit codes: 0 done, 2 out of memory, 3 other CUDA error, 64 usage.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

extern CUresult cuInit(unsigned int);
extern CUresult cuDeviceGet(CUdevice *, int);
extern CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
extern CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
extern CUresult cuMemFree_v2(CUdeviceptr);
extern CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               void *, void **, void **);

static volatile sig_atomic_t g_stop;

static void on_term(int sig)
{
    (void)sig;
    g_stop = 1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_s(double s)
{
    if (s <= 0)
        return;
    struct timespec ts;
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR && !g_stop) {
    }
}

/* runnable time of this thread: CPU time + run-queue wait (schedstat field 2) */
static double runnable_s(int fd)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    double t = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    char buf[128];
    ssize_t n = fd >= 0 ? pread(fd, buf, sizeof(buf) - 1, 0) : -1;
    if (n > 0) {
        buf[n] = 0;
        char *p = strchr(buf, ' ');
        if (p)
            t += (double)strtoull(p + 1, NULL, 10) / 1e9;
    }
    return t;
}

static int usage(void)
{
    fprintf(stderr, "usage: simworker [--gpu N] [--mib-per-step M] [--steps S] [--interval-s T] "
                    "[--duty D] [--kernel-ms K] [--lifetime-s L] [--free]\n");
    return 64;
}

int main(int argc, char **argv)
{
    int gpu = 0, steps = 1, do_free = 0;
    double mib = 0, interval_s = 0, duty = 0, kernel_ms = 10, lifetime_s = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--free") == 0) {
            do_free = 1;
            continue;
        }
        if (!v)
            return usage();
        if (strcmp(a, "--gpu") == 0)
            gpu = atoi(v);
        else if (strcmp(a, "--mib-per-step") == 0 || strcmp(a, "--mib") == 0)
            mib = atof(v);
        else if (strcmp(a, "--steps") == 0)
            steps = atoi(v);
        else if (strcmp(a, "--interval-s") == 0)
            interval_s = atof(v);
        else if (strcmp(a, "--duty") == 0)
            duty = atof(v);
        else if (strcmp(a, "--kernel-ms") == 0)
            kernel_ms = atof(v);
        else if (strcmp(a, "--lifetime-s") == 0)
            lifetime_s = atof(v);
        else
            return usage();
        i++;
    }
    if (duty < 0 || duty > 1 || kernel_ms <= 0 || steps < 0)
        return usage();
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);

    CUdevice dev;
    CUcontext ctx;
    CUresult r = cuInit(0);
    if (!r)
        r = cuDeviceGet(&dev, gpu);
    if (!r)
        r = cuCtxCreate_v2(&ctx, 0, dev);
    if (r) {
        fprintf(stderr, "simworker: CUDA init failed: %d\n", r);
        return 3;
    }
    CUdeviceptr *ptrs = calloc((size_t)(steps > 0 ? steps : 1), sizeof(*ptrs));
    uint64_t bytes = (uint64_t)(mib * 1048576.0), held = 0;
    double start = now_s();
    for (int s = 0; s < steps && bytes > 0 && !g_stop; s++) {
        r = cuMemAlloc_v2(&ptrs[s], bytes);
        if (r == 2) {
            printf("oom %d %llu\n", (int)getpid(), (unsigned long long)held);
            fflush(stdout);
            return 2;
        }
        if (r) {
            fprintf(stderr, "simworker: cuMemAlloc_v2 failed: %d\n", r);
            return 3;
        }
        held += bytes;
        if (s + 1 < steps)
            sleep_s(interval_s);
    }
    printf("ready %d %llu\n", (int)getpid(), (unsigned long long)held);
    fflush(stdout);

    uint64_t kernel_us = (uint64_t)(kernel_ms * 1000.0);
    void *params[1] = {&kernel_us};
    int sfd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    /* Duty schedule: the next kernel starts when busy / duty of wall time has passed,
     * where busy is the runnable time the launches really took (what the stub credits),
     * so busy / wall == duty however long each launch or wake-up took. A late start
     * is made up by the next kernels; a long stall (frozen, stopped) is not: at most
     * half a second of backlog is kept. */
    double next = now_s();
    while (!g_stop && (lifetime_s <= 0 || now_s() - start < lifetime_s)) {
        if (duty <= 0) {
            sleep_s(0.1);
            continue;
        }
        double r0 = runnable_s(sfd);
        r = cuLaunchKernel((void *)1, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
        if (r) {
            fprintf(stderr, "simworker: cuLaunchKernel failed: %d\n", r);
            return 3;
        }
        /* on a node whose kernels sleep (sim up --kernel-host sleep) the launch is mostly
         * asleep: its busy time is then at least the kernel's duration */
        double busy = runnable_s(sfd) - r0;
        if (busy < kernel_us / 1e6)
            busy = kernel_us / 1e6;
        next += busy / duty;
        double now = now_s();
        if (next < now - 0.5)
            next = now - 0.5;
        sleep_s(next - now);
    }
    if (do_free)
        for (int s = 0; s < steps; s++)
            if (ptrs[s])
                cuMemFree_v2(ptrs[s]);
    return 0;
}
