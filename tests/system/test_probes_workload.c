/* A tiny GPU-driver-shaped workload for the probe tests (compiled by the tests into tmp).
 *
 * It opens char device nodes under PREFIX and issues real-encoded NVIDIA ioctls (RM_ALLOC as
 * NVOS21/NVOS64, RM_FREE as NVOS00, optionally wrapped in IOCTL_XFER_CMD), and calls
 * cuMemAlloc_v2 & co. in a library it dlopen()s. Commands come from argv:
 *   open NAME | close FDI | ioctl FDI NR COUNT
 *   rmalloc FDI ROOT OBJ CLASS SIZE FORM      FORM: 21, 64, x21 (xfer-wrapped NVOS21)
 *   rmfree FDI ROOT OBJ FORM                  FORM: 00, x00
 *   rmleak FDI ROOT FIRST_OBJ COUNT SIZE      COUNT video-memory allocs, never freed
 *   dlopen PATH | cualloc SIZE COUNT | cufree COUNT | cupitch WIDTH HEIGHT | cucreate SIZE
 *   curelease | culaunch COUNT | cugraph COUNT | pause (prints "ready", waits for a line)
 *   exec (re-exec itself with the remaining commands; device fds are O_CLOEXEC)
 *   opens NAME COUNT | dup FDI | dup2 FDI NEWFD (a number) | dupover FDI FDJ (dup2 onto fds[FDJ])
 *   dupfd FDI MIN (fcntl F_DUPFD_CLOEXEC)      each new fd is appended to the fd list
 *   fork (the child runs the remaining commands; the parent waits and exits with its status)
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define NV_IOCTL_MAGIC 'F'
#define ESC_RM_ALLOC 0x2B
#define ESC_RM_FREE 0x29
#define ESC_XFER 211

typedef struct { uint32_t hRoot, hObjectParent, hObjectNew, hClass; uint64_t pAllocParms;
                 uint32_t paramsSize, status; } NVOS21;
typedef struct { uint32_t hRoot, hObjectParent, hObjectNew, hClass; uint64_t pAllocParms;
                 uint64_t pRightsRequested; uint32_t paramsSize, flags, status, pad; } NVOS64;
typedef struct { uint32_t hRoot, hObjectParent, hObjectOld, status; } NVOS00;
typedef struct { uint32_t cmd, size; uint64_t ptr; } XFER;
typedef struct { uint8_t head[64]; uint64_t size; uint8_t tail[64]; } MEMPARAMS;

typedef int (*alloc_fn)(uint64_t *, size_t);
typedef int (*pitch_fn)(uint64_t *, size_t *, size_t, size_t, unsigned);
typedef int (*create_fn)(uint64_t *, size_t, const void *, unsigned long long);
typedef int (*free_fn)(uint64_t);
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*graph_fn)(void *, void *);

static int fds[1024];
static int nfds;
static uint64_t ptrs[1 << 16];
static int nptrs;
static uint64_t handle;
static void *lib;

static void die(const char *m) { perror(m); exit(2); }

static void xioctl(int fd, unsigned nr, unsigned size, void *arg)
{
    (void)ioctl(fd, _IOC(_IOC_READ | _IOC_WRITE, NV_IOCTL_MAGIC, nr, size), arg);
}

static void rm_call(int fd, unsigned nr, unsigned size, void *arg, int xfer)
{
    if (xfer) {
        XFER x = { nr, size, (uint64_t)(uintptr_t)arg };
        xioctl(fd, ESC_XFER, sizeof(x), &x);
    } else {
        xioctl(fd, nr, size, arg);
    }
}

static void *sym(const char *name)
{
    void *f = dlsym(lib, name);
    if (!f) die(name);
    return f;
}

int main(int argc, char **argv)
{
    const char *prefix = argv[1];
    for (int i = 2; i < argc; i++) {
        const char *c = argv[i];
        if (!strcmp(c, "open")) {
            char path[512];
            snprintf(path, sizeof(path), "%s%s", prefix, argv[++i]);
            int fd = open(path, O_RDWR | O_CLOEXEC);  /* as libcuda does */
            if (fd < 0) die(path);
            fds[nfds++] = fd;
        } else if (!strcmp(c, "opens")) {
            char path[512];
            snprintf(path, sizeof(path), "%s%s", prefix, argv[i + 1]);
            long n = atol(argv[i + 2]);
            i += 2;
            for (long k = 0; k < n && nfds < 1024; k++) {
                int fd = open(path, O_RDWR | O_CLOEXEC);
                if (fd < 0) die(path);
                fds[nfds++] = fd;
            }
        } else if (!strcmp(c, "dup")) {
            int fd = dup(fds[atoi(argv[++i])]);
            if (fd < 0) die("dup");
            fds[nfds++] = fd;
        } else if (!strcmp(c, "dup2")) {
            int fd = dup2(fds[atoi(argv[i + 1])], atoi(argv[i + 2]));
            i += 2;
            if (fd < 0) die("dup2");
            fds[nfds++] = fd;
        } else if (!strcmp(c, "dupover")) {
            int fd = dup2(fds[atoi(argv[i + 1])], fds[atoi(argv[i + 2])]);
            i += 2;
            if (fd < 0) die("dup2");
        } else if (!strcmp(c, "dupfd")) {
            int fd = fcntl(fds[atoi(argv[i + 1])], F_DUPFD_CLOEXEC, atoi(argv[i + 2]));
            i += 2;
            if (fd < 0) die("fcntl");
            fds[nfds++] = fd;
        } else if (!strcmp(c, "fork")) {
            fflush(stdout);
            pid_t child = fork();
            if (child < 0) die("fork");
            if (child > 0) {
                int status = 0;
                if (waitpid(child, &status, 0) < 0) die("waitpid");
                return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            }
        } else if (!strcmp(c, "close")) {
            close(fds[atoi(argv[++i])]);
        } else if (!strcmp(c, "ioctl")) {
            int fd = fds[atoi(argv[i + 1])];
            unsigned nr = strtoul(argv[i + 2], 0, 0);
            long n = atol(argv[i + 3]);
            i += 3;
            uint64_t buf[8] = {0};
            for (long k = 0; k < n; k++)
                xioctl(fd, nr, sizeof(buf), buf);
        } else if (!strcmp(c, "rmalloc") || !strcmp(c, "rmleak")) {
            int leak = !strcmp(c, "rmleak");
            int fd = fds[atoi(argv[i + 1])];
            uint32_t root = strtoul(argv[i + 2], 0, 0), obj = strtoul(argv[i + 3], 0, 0);
            uint32_t cls = leak ? 0x40 : strtoul(argv[i + 4], 0, 0);
            long count = leak ? atol(argv[i + 4]) : 1;
            uint64_t size = strtoull(argv[i + 5], 0, 0);
            const char *form = leak ? "21" : argv[i + 6];
            i += leak ? 5 : 6;
            MEMPARAMS mp = {0};
            mp.size = size;
            for (long k = 0; k < count; k++) {
                if (!strcmp(form, "64")) {
                    NVOS64 p = { root, 1, obj + k, cls, (uint64_t)(uintptr_t)&mp, 0, sizeof(mp), 0, 0, 0 };
                    rm_call(fd, ESC_RM_ALLOC, sizeof(p), &p, 0);
                } else {
                    NVOS21 p = { root, 1, obj + k, cls, (uint64_t)(uintptr_t)&mp, sizeof(mp), 0 };
                    rm_call(fd, ESC_RM_ALLOC, sizeof(p), &p, form[0] == 'x');
                }
            }
        } else if (!strcmp(c, "rmfree")) {
            int fd = fds[atoi(argv[i + 1])];
            NVOS00 p = { strtoul(argv[i + 2], 0, 0), 1, strtoul(argv[i + 3], 0, 0), 0 };
            rm_call(fd, ESC_RM_FREE, sizeof(p), &p, argv[i + 4][0] == 'x');
            i += 4;
        } else if (!strcmp(c, "dlopen")) {
            lib = dlopen(argv[++i], RTLD_NOW);
            if (!lib) { fprintf(stderr, "%s\n", dlerror()); exit(2); }
        } else if (!strcmp(c, "cualloc")) {
            alloc_fn f = (alloc_fn)sym("cuMemAlloc_v2");
            size_t size = strtoull(argv[i + 1], 0, 0);
            long n = atol(argv[i + 2]);
            i += 2;
            for (long k = 0; k < n; k++) {
                uint64_t p = 0;
                if (f(&p, size) == 0 && nptrs < (1 << 16))
                    ptrs[nptrs++] = p;
            }
        } else if (!strcmp(c, "cufree")) {
            free_fn f = (free_fn)sym("cuMemFree_v2");
            long n = atol(argv[++i]);
            for (long k = 0; k < n && nptrs > 0; k++)
                f(ptrs[--nptrs]);
        } else if (!strcmp(c, "cupitch")) {
            pitch_fn f = (pitch_fn)sym("cuMemAllocPitch_v2");
            uint64_t p = 0;
            size_t pitch = 0;
            if (f(&p, &pitch, strtoull(argv[i + 1], 0, 0), strtoull(argv[i + 2], 0, 0), 4) == 0)
                ptrs[nptrs++] = p;
            i += 2;
        } else if (!strcmp(c, "cucreate")) {
            create_fn f = (create_fn)sym("cuMemCreate");
            f(&handle, strtoull(argv[++i], 0, 0), 0, 0);
        } else if (!strcmp(c, "curelease")) {
            ((free_fn)sym("cuMemRelease"))(handle);
        } else if (!strcmp(c, "culaunch")) {
            launch_fn f = (launch_fn)sym("cuLaunchKernel");
            long n = atol(argv[++i]);
            for (long k = 0; k < n; k++)
                f(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
        } else if (!strcmp(c, "cugraph")) {
            graph_fn f = (graph_fn)sym("cuGraphLaunch");
            long n = atol(argv[++i]);
            for (long k = 0; k < n; k++)
                f(0, 0);
        } else if (!strcmp(c, "exec")) {
            /* re-exec this program with the remaining commands (O_CLOEXEC fds close) */
            char *args[256];
            int n = 0;
            args[n++] = argv[0];
            args[n++] = argv[1];
            for (int j = i + 1; j < argc && n < 255; j++)
                args[n++] = argv[j];
            args[n] = 0;
            execv("/proc/self/exe", args);
            die("execv");
        } else if (!strcmp(c, "pause")) {
            char line[16];
            printf("ready\n");
            fflush(stdout);
            if (!fgets(line, sizeof(line), stdin))
                return 0;
        } else {
            fprintf(stderr, "unknown command %s\n", c);
            return 2;
        }
    }
    return 0;
}
