/*
 * A program whose first GPU access is NVML's own, for tests/system/test_recorder.py.
 *
 * Built twice:
 *   -DFAKE_NVML -shared -o libnvidia-ml.so.1: a stand-in NVML whose nvmlInit_v2 opens
 *     $FAKE_NVML_DEV/nvidiactl and issues an ioctl while holding its own (error-checking)
 *     lock, as a real NVML does; re-entering it from inside that call aborts, so a
 *     recorder that asks NVML for the header at the wrong moment fails loudly;
 *   its destructor issues one more ioctl (the recorder's exit line must still come last);
 *   the program: nvmlInit_v2, then (unless argv[1] is "nvml-only") an open of
 *     $FAKE_NVML_DEV/nvidia0 by the program itself.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#define RM_CONTROL 0xc020462au

static void dev_path(char *buf, size_t cap, const char *name)
{
    const char *dir = getenv("FAKE_NVML_DEV");
    snprintf(buf, cap, "%s/%s", dir ? dir : "/nonexistent", name);
}

#ifdef FAKE_NVML
#define API __attribute__((visibility("default")))
typedef struct {
    unsigned long long total, free, used;
} memory_info;
typedef struct {
    unsigned int pid;
    unsigned long long used;
    unsigned int gi, ci;
} process_info;

static pthread_mutex_t g_lock;
static int g_fd = -1;

__attribute__((constructor)) static void setup(void)
{
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    pthread_mutex_init(&g_lock, &attr);
}

__attribute__((destructor)) static void teardown(void)
{
    unsigned char params[32] = {0};
    if (g_fd >= 0)
        (void)ioctl(g_fd, RM_CONTROL, params);
}

API int nvmlInit_v2(void)
{
    if (pthread_mutex_lock(&g_lock) == EDEADLK) {
        static const char msg[] = "fake nvml: nvmlInit_v2 re-entered from inside itself\n";
        (void)!write(2, msg, sizeof(msg) - 1);
        abort();
    }
    if (g_fd < 0) {
        char path[512];
        dev_path(path, sizeof(path), "nvidiactl");
        g_fd = open(path, O_RDWR | O_CLOEXEC);
        unsigned char params[32] = {0};
        (void)ioctl(g_fd, RM_CONTROL, params);
    }
    pthread_mutex_unlock(&g_lock);
    return 0;
}

API int nvmlDeviceGetCount_v2(unsigned int *n)
{
    *n = 1;
    return 0;
}

API int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **d)
{
    *d = (void *)(uintptr_t)(i + 1);
    return 0;
}

API int nvmlDeviceGetMinorNumber(void *d, unsigned int *m)
{
    (void)d;
    *m = 0;
    return 0;
}

API int nvmlDeviceGetUUID(void *d, char *buf, unsigned int len)
{
    (void)d;
    snprintf(buf, len, "GPU-fake-nvml");
    return 0;
}

API int nvmlDeviceGetName(void *d, char *buf, unsigned int len)
{
    (void)d;
    snprintf(buf, len, "fake NVML GPU");
    return 0;
}

API int nvmlDeviceGetMemoryInfo(void *d, memory_info *m)
{
    (void)d;
    m->total = 1ull << 30;
    m->used = 0;
    m->free = m->total;
    return 0;
}

API int nvmlDeviceGetComputeRunningProcesses_v3(void *d, unsigned int *count, process_info *p)
{
    (void)d;
    (void)p;
    *count = 0;
    return 0;
}
#else
int main(int argc, char **argv)
{
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    int (*init)(void) = nvml ? (int (*)(void))dlsym(nvml, "nvmlInit_v2") : NULL;
    if (!init) {
        printf("no NVML: %s\n", dlerror());
        return 2;
    }
    printf("nvmlInit_v2=%d\n", init());
    if (argc > 1 && strcmp(argv[1], "nvml-only") == 0)
        return 0;
    char path[512];
    dev_path(path, sizeof(path), "nvidia0");
    int fd = open(path, O_RDWR);
    printf("open nvidia0 %s\n", fd >= 0 ? "ok" : "failed");
    return 0;
}
#endif
