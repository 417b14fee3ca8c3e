/*
 * Calls for the ioctl recorder's edge cases (tests/system/test_recorder.py), made on
 * regular files named like NVIDIA device nodes in a directory given as argv[1] (the
 * recorder's prefix points there): a regular file answers FIONREAD and mmap, and fails
 * NVIDIA-encoded ioctls with ENOTTY, so both outcomes pass through the recorder.
 *
 * It prints what every call returned and the errno it saw; the test runs it with and
 * without the recorder and requires the same output and exit status (3). A forked child
 * uses an inherited fd (exit 7); another child execs this program with `--inherited FD`,
 * which issues one ioctl on the fd it got across exec (exit 9). A 100 us interval timer's
 * handler issues ioctls too, landing inside the recorder's own work now and then.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#define RM_ALLOC_NVOS21 0xc020462bu
#define RM_ALLOC_NVOS64 0xc030462bu
#define RM_CONTROL 0xc020462au
#define XFER 0xc01046d3u
#define UVM_INITIALIZE 0x30000001u
#define UVM_MAP_EXTERNAL_ALLOCATION 33u
#define UVM_ALLOC_SEMAPHORE_POOL 68u /* a size the recorder does not know */
#define UNKNOWN_CLASS 0x1234u

typedef struct {
    uint32_t hRoot, hObjectParent, hObjectNew, hClass;
    uint64_t pAllocParms;
    uint64_t pRightsRequested;
    uint32_t paramsSize, flags, status, pad;
} nvos64;

typedef struct {
    uint32_t hRoot, hObjectParent, hObjectNew, hClass;
    uint64_t pAllocParms;
    uint32_t paramsSize, status;
} nvos21;

typedef struct {
    uint32_t hClient, hObject, cmd, flags;
    uint64_t params;
    uint32_t paramsSize, status;
} nvos54;

typedef struct {
    uint32_t cmd, size;
    uint64_t ptr;
} xfer;

static int g_ctl;

static void show(const char *what, long ret)
{
    printf("%s ret=%ld errno=%d\n", what, ret, ret < 0 ? errno : 0);
    fflush(stdout);
}

static void alloc_params(unsigned char *p, uint64_t size)
{
    memset(p, 0, 128);
    memcpy(p + 64, &size, 8);
}

/* One NVOS64 RM_ALLOC of `hclass` with the given pAllocParms and paramsSize. */
static long rm_alloc64(uint32_t hclass, void *params, uint32_t params_size)
{
    nvos64 a;
    memset(&a, 0, sizeof(a));
    a.hClass = hclass;
    a.pAllocParms = (uint64_t)(uintptr_t)params;
    a.paramsSize = params_size;
    return ioctl(g_ctl, RM_ALLOC_NVOS64, &a);
}

/* RM_ALLOCs as real libcuda issues them (paramsSize 0: the RM sizes pAllocParms by class),
 * and the fallbacks for a class the recorder does not know. */
static void rm_alloc_by_class(void)
{
    unsigned char mem[128], mem2[128], mem3[128], xfer_mem[128];
    alloc_params(mem, 7u << 20);
    show("rm_alloc class 0x40 paramsSize 0", rm_alloc64(0x40, mem, 0));
    unsigned char device[56];
    memset(device, 0, sizeof(device));
    device[0] = 1; /* deviceId */
    show("rm_alloc class 0x80 paramsSize 0", rm_alloc64(0x80, device, 0));
    show("rm_alloc class 0x41 NULL params", rm_alloc64(0x41, NULL, 0));
    uint32_t client = 0xc1d00001;
    show("rm_alloc class 0x41 paramsSize 0", rm_alloc64(0x41, &client, 0));
    unsigned char other[16];
    memset(other, 0xab, sizeof(other));
    show("rm_alloc unknown class paramsSize 0", rm_alloc64(UNKNOWN_CLASS, other, 0));
    show("rm_alloc unknown class paramsSize 16", rm_alloc64(UNKNOWN_CLASS, other, sizeof(other)));
    alloc_params(mem2, 9u << 20);
    show("rm_alloc class 0x40 paramsSize 8", rm_alloc64(0x40, mem2, 8)); /* the class wins */

    alloc_params(mem3, 11u << 20);
    nvos21 a21;
    memset(&a21, 0, sizeof(a21));
    a21.hClass = 0x40;
    a21.pAllocParms = (uint64_t)(uintptr_t)mem3;
    show("rm_alloc nvos21 class 0x40 paramsSize 0", ioctl(g_ctl, RM_ALLOC_NVOS21, &a21));

    alloc_params(xfer_mem, 13u << 20);
    nvos64 inner;
    memset(&inner, 0, sizeof(inner));
    inner.hClass = 0x40;
    inner.pAllocParms = (uint64_t)(uintptr_t)xfer_mem;
    xfer x = {0x2B, sizeof(inner), (uint64_t)(uintptr_t)&inner};
    show("xfer rm_alloc class 0x40 paramsSize 0", ioctl(g_ctl, XFER, &x));
}

static void *control_storm(void *arg)
{
    nvos54 c;
    memset(&c, 0, sizeof(c));
    c.cmd = (uint32_t)(uintptr_t)arg;
    int failures = 0;
    for (int i = 0; i < 200; i++)
        if (ioctl(g_ctl, RM_CONTROL, &c) != -1 || errno != ENOTTY)
            failures++;
    return (void *)(uintptr_t)failures;
}

static volatile sig_atomic_t g_signal_failures;

/* a signal handler that issues a device ioctl, possibly while the recorder is busy */
static void on_alarm(int sig)
{
    (void)sig;
    int saved = errno;
    nvos54 c;
    memset(&c, 0, sizeof(c));
    c.cmd = 0x5151;
    if (ioctl(g_ctl, RM_CONTROL, &c) != -1 || errno != ENOTTY)
        g_signal_failures++;
    errno = saved;
}

static char *path_in(const char *dir, const char *name)
{
    static char buf[4][512];
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, 512, "%s/%s", dir, name);
    return p;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--inherited") == 0) {
        nvos54 c;
        memset(&c, 0, sizeof(c));
        return ioctl(atoi(argv[2]), RM_CONTROL, &c) == -1 && errno == ENOTTY ? 9 : 1;
    }
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    g_ctl = open(path_in(dir, "nvidiactl"), O_RDWR | O_CLOEXEC);
    show("open nvidiactl", g_ctl);

    int n = -1;
    errno = 4242; /* a successful call leaves errno alone, recorded or not */
    show("ioctl FIONREAD", ioctl(g_ctl, FIONREAD, &n));
    printf("errno after success=%d fionread=%d\n", errno, n);

    unsigned char params[128];
    alloc_params(params, 3u << 20);
    nvos64 a64;
    memset(&a64, 0, sizeof(a64));
    a64.hClass = 0x40;
    a64.pAllocParms = (uint64_t)(uintptr_t)params;
    a64.paramsSize = sizeof(params);
    show("rm_alloc nvos64", ioctl(g_ctl, RM_ALLOC_NVOS64, &a64));

    nvos21 a21;
    memset(&a21, 0, sizeof(a21));
    a21.hClass = 0x40;
    a21.pAllocParms = 0x10; /* not mapped: the recorder must not fault */
    a21.paramsSize = 128;
    show("rm_alloc nvos21 bad params pointer", ioctl(g_ctl, RM_ALLOC_NVOS21, &a21));
    show("rm_alloc bad struct pointer", ioctl(g_ctl, RM_ALLOC_NVOS64, (void *)1));

    size_t big = 1u << 20;
    unsigned char *huge = calloc(1, big);
    nvos54 ctl;
    memset(&ctl, 0, sizeof(ctl));
    ctl.cmd = 0x2080012b;
    ctl.params = (uint64_t)(uintptr_t)huge;
    ctl.paramsSize = (uint32_t)big;
    show("rm_control 1 MiB params", ioctl(g_ctl, RM_CONTROL, &ctl));
    free(huge);

    unsigned char inner_params[128];
    alloc_params(inner_params, 5u << 20);
    nvos64 inner;
    memset(&inner, 0, sizeof(inner));
    inner.hClass = 0x40;
    inner.pAllocParms = (uint64_t)(uintptr_t)inner_params;
    inner.paramsSize = sizeof(inner_params);
    xfer x = {0x2B, sizeof(inner), (uint64_t)(uintptr_t)&inner};
    show("xfer rm_alloc", ioctl(g_ctl, XFER, &x));
    rm_alloc_by_class();

    int d1 = dup(g_ctl);
    show("dup", d1);
    show("dup2", dup2(g_ctl, 100));
    show("dup3", dup3(g_ctl, 101, O_CLOEXEC));
    show("fcntl F_DUPFD_CLOEXEC", fcntl(g_ctl, F_DUPFD_CLOEXEC, 200));
    show("close dup", close(d1));
    show("close 100", close(100));
    show("close 101", close(101));
    show("close 200", close(200));
    show("close bad fd", close(9999));

    void *m = mmap(NULL, 4096, PROT_READ, MAP_SHARED, g_ctl, 0);
    show("mmap", m == MAP_FAILED ? -1 : 0);
    if (m != MAP_FAILED)
        munmap(m, 4096);

    show("open missing nvidia9", open(path_in(dir, "nvidia9"), O_RDWR));
    int other = open(path_in(dir, "unrelated"), O_RDWR);
    show("open unrelated", other);
    show("ioctl FIONREAD unrelated", ioctl(other, FIONREAD, &n));
    close(other);

    int uvm = open(path_in(dir, "nvidia-uvm"), O_RDWR | O_CLOEXEC);
    show("open nvidia-uvm", uvm);
    unsigned char init[16] = {2};
    show("uvm initialize", ioctl(uvm, UVM_INITIALIZE, init));
    uint64_t map_external[64] = {0x7f0000200000ull, 2u << 20, 4096}; /* base, length, offset, ... */
    show("uvm map external", ioctl(uvm, UVM_MAP_EXTERNAL_ALLOCATION, map_external));
    unsigned char unknown[64] = {0};
    show("uvm alloc semaphore pool", ioctl(uvm, UVM_ALLOC_SEMAPHORE_POOL, unknown));

    pthread_t threads[4];
    for (uintptr_t i = 0; i < 4; i++)
        pthread_create(&threads[i], NULL, control_storm, (void *)(0x100 + i));
    uintptr_t failures = 0;
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(threads[i], &r);
        failures += (uintptr_t)r;
    }
    printf("threads: 800 ioctls, %lu unexpected results\n", (unsigned long)failures);

    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval every = {{0, 100}, {0, 100}}, off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &every, NULL);
    int interrupted_failures = 0;
    nvos54 quiet;
    memset(&quiet, 0, sizeof(quiet));
    for (int i = 0; i < 3000; i++)
        if (ioctl(g_ctl, RM_CONTROL, &quiet) != -1 || errno != ENOTTY)
            interrupted_failures++;
    setitimer(ITIMER_REAL, &off, NULL);
    printf("signals: %d unexpected results in the loop, %d in handlers\n", interrupted_failures,
           (int)g_signal_failures);

    void (*checkpoint)(const char *) = (void (*)(const char *))dlsym(RTLD_DEFAULT, "gwrec_checkpoint");
    if (checkpoint)
        checkpoint("synthetic");

    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        for (int i = 0; i < 3; i++)
            (void)ioctl(g_ctl, RM_CONTROL, &ctl);
        exit(7);
    }
    int status = 0;
    waitpid(child, &status, 0);
    printf("child exit=%d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);

    int kept = open(path_in(dir, "nvidiactl"), O_RDWR); /* no O_CLOEXEC: survives exec */
    fflush(stdout);
    child = fork();
    if (child == 0) {
        char fd_text[16];
        snprintf(fd_text, sizeof(fd_text), "%d", kept);
        execl("/proc/self/exe", argv[0], "--inherited", fd_text, (char *)NULL);
        _exit(1);
    }
    waitpid(child, &status, 0);
    printf("exec child exit=%d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    close(kept);

    show("close uvm", close(uvm));
    show("close nvidiactl", close(g_ctl));
    return 3;
}
