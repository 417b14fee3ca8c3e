/*
 * gwrec: an LD_PRELOAD recorder of the ioctls a process issues on NVIDIA device nodes.
 *
 * Why: how libcuda drives the NVIDIA kernel driver (one RM allocation per cuMemAlloc or
 * carved from chunks, which escape, what a context allocates) is not in any source; it
 * has to be watched on a real GPU host. This recorder needs nothing but a C compiler
 * there (no BCC, no Python), and writes traces that `gpuwatch sim replay` re-issues on
 * the simulated node so the real BPF probes decode real driver traffic in CI.
 *
 * Trace format: gpuwatch/sim/TRACE_FORMAT.md (version 1), JSON Lines, one file per
 * process, <GPUWATCH_REC_DIR>/<pid>.jsonl. Build and use: gpuwatch/sim/RECORDING.md.
 *
 *   cc -O2 -shared -fPIC -o libgwrec.so ioctl_recorder.c -ldl -lpthread
 *   GPUWATCH_REC_DIR=traces LD_PRELOAD=$PWD/libgwrec.so ./program
 *
 * Configuration (environment):
 *   GPUWATCH_REC_DIR     where traces go (created if missing); unset: record nothing.
 *   GPUWATCH_REC_PREFIX  device path prefix to track (default /dev/nvidia). Recorded
 *                        paths are rewritten to start with /dev/nvidia, so a trace taken
 *                        on the simulated node (<sim root>/dev/nvidia...) looks like one
 *                        taken on a GPU host.
 *
 * Rules it keeps:
 *   - the interposed call is made exactly as asked; its result and errno are returned
 *     unchanged; user memory is read with process_vm_readv, so a bad pointer the driver
 *     would answer with EFAULT never crashes the recorder;
 *   - copies are bounded: a nested block is captured up to 64 KiB ("truncated": true
 *     and "declared_size" say how much was declared);
 *   - thread-safe: a line is built in a per-thread buffer and written under a mutex;
 *     a thread already inside the recorder (a signal handler that issues an ioctl, or
 *     NVML called by the recorder itself) passes straight through unrecorded;
 *   - the trace file is created at the first tracked open (or checkpoint), so helper
 *     processes that never touch a GPU leave no file; a forked child starts its own file
 *     and first lists the tracked fds it inherited ("open" events with "inherited": true).
 *
 * Checkpoints: a program may call gwrec_checkpoint("name") (resolve it with
 * dlsym(RTLD_DEFAULT, ...): it exists only where the recorder is preloaded). The recorder
 * then asks NVML (libnvidia-ml.so.1, loaded on demand and never from inside NVML's own
 * calls) for this process's used memory per GPU.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))
#define TLS __thread __attribute__((tls_model("initial-exec")))

#define NESTED_CAP_BYTES (64u * 1024u)
#define MAX_TRACKED_FD (1 << 20)
#define MAX_PATHS 255
#define PATH_CAP 256

/* ---- ioctl encoding (asm-generic, as used on x86-64 and arm64) ---- */
#define IOC_NR(c) ((c)&0xffu)
#define IOC_TYPE(c) (((c) >> 8) & 0xffu)
#define IOC_SIZE(c) (((c) >> 16) & 0x3fffu)
#define NV_MAGIC 0x46u
#define NV_ESC_RM_CONTROL 0x2Au
#define NV_ESC_RM_ALLOC 0x2Bu
#define NV_ESC_IOCTL_XFER_CMD 211u

/* ---- real functions ---- */
typedef int (*open_fn)(const char *, int, ...);
typedef int (*openat_fn)(int, const char *, int, ...);
typedef int (*close_fn)(int);
typedef int (*dup_fn)(int);
typedef int (*dup2_fn)(int, int);
typedef int (*dup3_fn)(int, int, int);
typedef int (*fcntl_fn)(int, int, ...);
typedef int (*ioctl_fn)(int, unsigned long, ...);
typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);
typedef int (*close_range_fn)(unsigned int, unsigned int, int);

static struct {
    open_fn open, open64;
    openat_fn openat, openat64;
    close_fn close;
    dup_fn dup;
    dup2_fn dup2;
    dup3_fn dup3;
    fcntl_fn fcntl, fcntl64;
    ioctl_fn ioctl;
    mmap_fn mmap, mmap64;
    close_range_fn close_range;
} real;

/* the next definition of `name` after ours (libc's), looked up once */
static void *resolve(void **slot, const char *name)
{
    void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!p) {
        p = dlsym(RTLD_NEXT, name);
        __atomic_store_n(slot, p, __ATOMIC_RELEASE);
    }
    return p;
}

#define REAL(fn, type) ((type)resolve((void **)&real.fn, #fn))

/* ---- state ---- */
static int g_enabled;                 /* GPUWATCH_REC_DIR set and usable */
static char g_dir[PATH_CAP];
static char g_prefix[PATH_CAP] = "/dev/nvidia";
static size_t g_prefix_len = 11;
static pthread_mutex_t g_write_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_path_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_trace_fd = -1;           /* -1: not created yet or lost */
static char g_trace_path[PATH_CAP + 64];
static int g_trace_created;           /* header written for this process */
static int g_inherited_fds;           /* tracked fds came from a parent (fork or exec) */
static int g_finished;                /* exit line written: record nothing more */
static int g_failed;                  /* a write failed: recording stopped */
/* lines that came before the header could be written (see emit) */
#define PENDING_CAP_BYTES (64ul << 20)
static char *g_pending;
static size_t g_pending_len, g_pending_cap;

/* fd -> 1 + index into g_paths (0 = not tracked) */
static uint8_t g_fd_path[MAX_TRACKED_FD];
static char g_paths[MAX_PATHS][PATH_CAP];
static int g_path_count;

static TLS int t_busy;                /* this thread is inside the recorder */
static TLS void *t_caller;            /* return address of the interposed call being made */
static TLS char *t_buf;               /* per-thread scratch (mmap'd) */
static TLS size_t t_buf_cap;
static pthread_key_t g_buf_key;

static int sys_close(int fd)
{
    return (int)syscall(SYS_close, fd);
}

/* ---- per-thread scratch memory (mmap, so usable where malloc is not) ---- */
static void free_thread_buffer(void *p)
{
    (void)p;
    if (t_buf)
        syscall(SYS_munmap, t_buf, t_buf_cap);
    t_buf = NULL;
    t_buf_cap = 0;
}

static char *scratch(size_t need)
{
    if (t_buf_cap >= need)
        return t_buf;
    size_t cap = 1u << 20;
    while (cap < need)
        cap <<= 1;
    void *p = (void *)syscall(SYS_mmap, NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    if (t_buf)
        syscall(SYS_munmap, t_buf, t_buf_cap);
    t_buf = p;
    t_buf_cap = cap;
    pthread_setspecific(g_buf_key, t_buf);
    return t_buf;
}

/* ---- small text builder over a fixed buffer ---- */
struct out {
    char *p;
    size_t len, cap;
    int overflow;
};

static void put(struct out *o, const char *s, size_t n)
{
    if (o->len + n > o->cap) {
        o->overflow = 1;
        return;
    }
    memcpy(o->p + o->len, s, n);
    o->len += n;
}

static void puts_(struct out *o, const char *s)
{
    put(o, s, strlen(s));
}

static void putf(struct out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(struct out *o, const char *fmt, ...)
{
    if (o->overflow)
        return;
    va_list ap;
    va_start(ap, fmt);
    size_t room = o->cap - o->len;
    int n = vsnprintf(o->p + o->len, room, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= room)
        o->overflow = 1;
    else
        o->len += (size_t)n;
}

static void put_hex(struct out *o, const unsigned char *b, size_t n)
{
    static const char digits[] = "0123456789abcdef";
    if (o->len + 2 * n > o->cap) {
        o->overflow = 1;
        return;
    }
    char *d = o->p + o->len;
    for (size_t i = 0; i < n; i++) {
        d[2 * i] = digits[b[i] >> 4];
        d[2 * i + 1] = digits[b[i] & 15];
    }
    o->len += 2 * n;
}

/* length of a valid UTF-8 sequence at s (0 if invalid) */
static size_t utf8_len(const unsigned char *s, size_t left)
{
    size_t n = s[0] >= 0xf0 && s[0] <= 0xf4 ? 4 : s[0] >= 0xe0 ? 3 : s[0] >= 0xc2 ? 2 : 0;
    if (n == 0 || n > left)
        return 0;
    for (size_t i = 1; i < n; i++)
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    return n;
}

/* a JSON string; bytes that are not valid UTF-8 become \u00XX (never invalid JSON) */
static void put_json_str(struct out *o, const char *s, size_t n)
{
    put(o, "\"", 1);
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            put(o, e, 2);
            i++;
        } else if (c < 0x20) {
            putf(o, "\\u%04x", c);
            i++;
        } else if (c < 0x80) {
            put(o, s + i, 1);
            i++;
        } else {
            size_t k = utf8_len((const unsigned char *)s + i, n - i);
            if (k) {
                put(o, s + i, k);
                i += k;
            } else {
                putf(o, "\\u%04x", c);
                i++;
            }
        }
    }
    put(o, "\"", 1);
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static pid_t g_pid;                   /* getpid() is a system call: cached, reset at fork */
static TLS long t_tid;

static long tid(void)
{
    if (!t_tid)
        t_tid = syscall(SYS_gettid);
    return t_tid;
}

/* ---- safe reads of the caller's memory ---- */
static int g_vm_readv_works = 1;

/* Copy n bytes at addr; 0 on success, -1 when (part of) the range is not readable. */
static int read_user(void *dst, uint64_t addr, size_t n)
{
    if (n == 0)
        return 0;
    if (addr == 0)
        return -1;
    if (g_vm_readv_works) {
        struct iovec local = {dst, n};
        struct iovec remote = {(void *)(uintptr_t)addr, n};
        ssize_t got = syscall(SYS_process_vm_readv, g_pid, &local, 1ul, &remote, 1ul, 0ul);
        if (got == (ssize_t)n)
            return 0;
        if (got >= 0 || errno == EFAULT)
            return -1;
        /* ENOSYS / EPERM (seccomp): trust the pointer, as the driver would read it */
        g_vm_readv_works = 0;
    }
    memcpy(dst, (const void *)(uintptr_t)addr, n);
    return 0;
}

static uint64_t get_u64(const unsigned char *b, size_t at)
{
    uint64_t v;
    memcpy(&v, b + at, 8);
    return v;
}

static uint32_t get_u32(const unsigned char *b, size_t at)
{
    uint32_t v;
    memcpy(&v, b + at, 4);
    return v;
}

/* ---- trace file ---- */

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = syscall(SYS_write, fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void warn(const char *msg)
{
    char line[PATH_CAP * 2];
    int n = snprintf(line, sizeof(line), "gwrec[%d]: %s\n", (int)getpid(), msg);
    if (n > 0)
        (void)!write(2, line, (size_t)n < sizeof(line) ? (size_t)n : sizeof(line) - 1);
}

/* Move our fd out of the range programs use, so closing "all fds from 3" is rare. */
static int park_fd(int fd)
{
    int high = REAL(fcntl, fcntl_fn)(fd, F_DUPFD_CLOEXEC, 900);
    if (high < 0)
        return fd;
    sys_close(fd);
    return high;
}

/* Open (or re-open after the program closed our fd) the trace file; under g_write_lock. */
static int trace_fd_locked(void)
{
    if (g_trace_fd >= 0)
        return g_trace_fd;
    if (g_trace_path[0]) {
        int fd = (int)syscall(SYS_openat, AT_FDCWD, g_trace_path, O_WRONLY | O_APPEND | O_CLOEXEC);
        if (fd >= 0)
            g_trace_fd = park_fd(fd);
        return g_trace_fd;
    }
    int pid = (int)getpid();
    for (int k = 0; k < 100; k++) {
        if (k == 0)
            snprintf(g_trace_path, sizeof(g_trace_path), "%s/%d.jsonl", g_dir, pid);
        else /* the same pid after exec, or a recycled pid */
            snprintf(g_trace_path, sizeof(g_trace_path), "%s/%d-%d.jsonl", g_dir, pid, k);
        int fd = (int)syscall(SYS_openat, AT_FDCWD, g_trace_path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC,
                              0644);
        if (fd >= 0) {
            g_trace_fd = park_fd(fd);
            return g_trace_fd;
        }
        if (errno != EEXIST)
            break;
    }
    g_trace_path[0] = 0;
    return -1;
}

static void write_line_locked(struct out *o)
{
    if (g_failed)
        return;
    if (o->overflow) {
        warn("trace line too long; event dropped");
        return;
    }
    int fd = trace_fd_locked();
    if (fd < 0 || write_all(fd, o->p, o->len) < 0) {
        g_failed = 1;
        warn("cannot write the trace file; recording stopped");
    }
}

static void ensure_header(void);

/* Is the interposed call being recorded made by NVML itself? */
static int caller_is_nvml(void)
{
    Dl_info info;
    if (!t_caller || !dladdr(t_caller, &info) || !info.dli_fname)
        return 0;
    return strstr(info.dli_fname, "libnvidia-ml") != NULL;
}

/* Keep a line until the header can be written; under g_write_lock. */
static void pending_append_locked(const struct out *o)
{
    if (g_pending_len + o->len > g_pending_cap) {
        size_t cap = g_pending_cap ? g_pending_cap : (1ul << 20);
        while (cap < g_pending_len + o->len)
            cap *= 2;
        void *p = cap > PENDING_CAP_BYTES ? MAP_FAILED
                                          : (void *)syscall(SYS_mmap, NULL, cap, PROT_READ | PROT_WRITE,
                                                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            g_failed = 1;
            warn("too many events before the trace header could be written; recording stopped");
            return;
        }
        if (g_pending) {
            memcpy(p, g_pending, g_pending_len);
            syscall(SYS_munmap, g_pending, g_pending_cap);
        }
        g_pending = p;
        g_pending_cap = cap;
    }
    memcpy(g_pending + g_pending_len, o->p, o->len);
    g_pending_len += o->len;
}

static void pending_flush_locked(void)
{
    if (g_pending && !g_failed) {
        int fd = trace_fd_locked();
        if (fd < 0 || write_all(fd, g_pending, g_pending_len) < 0) {
            g_failed = 1;
            warn("cannot write the trace file; recording stopped");
        }
    }
    if (g_pending)
        syscall(SYS_munmap, g_pending, g_pending_cap);
    g_pending = NULL;
    g_pending_len = g_pending_cap = 0;
}

/* Write one finished line (creating the file and its header first).
 *
 * The header asks NVML for the GPUs. When the call being recorded is NVML's own (a program
 * whose first GPU access is nvmlInit), asking NVML from inside it would re-enter NVML, so
 * the line waits in memory until a call from elsewhere, a checkpoint or exit writes the
 * header. */
static void emit(struct out *o)
{
    put(o, "\n", 1);
    if (!__atomic_load_n(&g_trace_created, __ATOMIC_ACQUIRE) && caller_is_nvml()) {
        pthread_mutex_lock(&g_write_lock);
        int waiting = !g_trace_created;
        if (waiting && !g_finished && !g_failed)
            pending_append_locked(o);
        pthread_mutex_unlock(&g_write_lock);
        if (waiting)
            return;
    }
    ensure_header();
    pthread_mutex_lock(&g_write_lock);
    if (!g_finished)
        write_line_locked(o);
    pthread_mutex_unlock(&g_write_lock);
}

/* ---- fd table ---- */

static int path_index_of(const char *norm)
{
    for (int i = 0; i < __atomic_load_n(&g_path_count, __ATOMIC_ACQUIRE); i++)
        if (strcmp(g_paths[i], norm) == 0)
            return i;
    pthread_mutex_lock(&g_path_lock);
    int found = -1;
    for (int i = 0; i < g_path_count; i++)
        if (strcmp(g_paths[i], norm) == 0)
            found = i;
    if (found < 0 && g_path_count < MAX_PATHS) {
        snprintf(g_paths[g_path_count], PATH_CAP, "%s", norm);
        found = g_path_count;
        __atomic_store_n(&g_path_count, g_path_count + 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_path_lock);
    return found;
}

static int tracked(int fd)
{
    return fd >= 0 && fd < MAX_TRACKED_FD && __atomic_load_n(&g_fd_path[fd], __ATOMIC_RELAXED) != 0;
}

static const char *fd_path(int fd)
{
    return g_paths[g_fd_path[fd] - 1];
}

static void set_fd(int fd, int path_index)
{
    if (fd >= 0 && fd < MAX_TRACKED_FD)
        __atomic_store_n(&g_fd_path[fd], (uint8_t)(path_index + 1), __ATOMIC_RELAXED);
}

static void clear_fd(int fd)
{
    if (fd >= 0 && fd < MAX_TRACKED_FD)
        __atomic_store_n(&g_fd_path[fd], 0, __ATOMIC_RELAXED);
}

static int is_uvm_fd(int fd)
{
    return strncmp(fd_path(fd), "/dev/nvidia-uvm", 15) == 0;
}

/* The absolute form of `path` opened relative to dirfd, into buf; NULL if unknown. */
static const char *absolute(int dirfd, const char *path, char *buf, size_t cap)
{
    if (!path)
        return NULL;
    if (path[0] == '/')
        return path;
    char base[PATH_CAP];
    if (dirfd == AT_FDCWD) {
        if (!getcwd(base, sizeof(base)))
            return NULL;
    } else {
        char link[64];
        snprintf(link, sizeof(link), "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, base, sizeof(base) - 1);
        if (n <= 0)
            return NULL;
        base[n] = 0;
    }
    int n = snprintf(buf, cap, "%s/%s", base, path);
    return n > 0 && (size_t)n < cap ? buf : NULL;
}

/* "/dev/nvidia" + what follows the configured prefix, or NULL when not a device node */
static const char *normalized(const char *abs, char *buf, size_t cap)
{
    if (!abs || strncmp(abs, g_prefix, g_prefix_len) != 0)
        return NULL;
    int n = snprintf(buf, cap, "/dev/nvidia%s", abs + g_prefix_len);
    return n > 0 && (size_t)n < cap ? buf : NULL;
}

/* ---- events ---- */

static struct out line_out(size_t need)
{
    struct out o = {scratch(need), 0, need, 0};
    if (!o.p)
        o.cap = 0;
    return o;
}

static void after_open(int dirfd, const char *path, int flags, int fd, int err)
{
    if (!g_enabled || g_finished || g_failed) {
        if (fd >= 0)
            clear_fd(fd);
        return;
    }
    char abuf[PATH_CAP * 2], nbuf[PATH_CAP];
    const char *norm = path ? normalized(absolute(dirfd, path, abuf, sizeof(abuf)), nbuf, sizeof(nbuf)) : NULL;
    if (!norm || t_busy) {
        if (fd >= 0)
            clear_fd(fd);
        return;
    }
    t_busy = 1;
    int idx = path_index_of(norm);
    if (fd >= 0)
        clear_fd(fd);
    struct out o = line_out(4096);
    putf(&o, "{\"ev\": \"open\", \"t_ns\": %llu, \"tid\": %ld, \"path\": ", (unsigned long long)mono_ns(), tid());
    put_json_str(&o, norm, strlen(norm));
    putf(&o, ", \"flags\": %d, \"fd\": %d", flags, fd);
    if (fd < 0)
        putf(&o, ", \"errno\": %d", err);
    puts_(&o, "}");
    emit(&o);
    /* tracked only now: a forked child's header lists tracked fds as inherited */
    if (fd >= 0 && idx >= 0)
        set_fd(fd, idx);
    t_busy = 0;
}

static void emit_close(int fd)
{
    struct out o = line_out(256);
    putf(&o, "{\"ev\": \"close\", \"t_ns\": %llu, \"tid\": %ld, \"fd\": %d}", (unsigned long long)mono_ns(), tid(),
         fd);
    emit(&o);
}

/* fd was closed (or replaced): drop it, and say so if it was tracked */
static void forget_fd(int fd)
{
    if (!tracked(fd))
        return;
    int busy = t_busy;
    clear_fd(fd);
    if (!g_enabled || busy || g_finished || g_failed)
        return;
    t_busy = 1;
    emit_close(fd);
    t_busy = 0;
}

/* newfd is now a copy of oldfd (dup, dup2, dup3, F_DUPFD) */
static void after_dup(int oldfd, int newfd)
{
    if (newfd < 0 || newfd == oldfd)
        return;
    if (!tracked(oldfd)) {
        forget_fd(newfd);
        return;
    }
    forget_fd(newfd);
    int idx = g_fd_path[oldfd] - 1;
    if (g_enabled && !t_busy && !g_finished && !g_failed) {
        t_busy = 1;
        struct out o = line_out(256);
        putf(&o, "{\"ev\": \"dup\", \"t_ns\": %llu, \"fd\": %d, \"newfd\": %d}", (unsigned long long)mono_ns(),
             oldfd, newfd);
        emit(&o);
        t_busy = 0;
    }
    set_fd(newfd, idx);
}

/* our own trace fd was closed or overwritten by the program: reopen it on next write */
static void trace_fd_lost(int fd)
{
    if (fd >= 0 && fd == g_trace_fd)
        g_trace_fd = -1;
}

/* ---- ioctl capture ---- */

/* One captured block: the struct an ioctl points at, or a block that struct points to. */
struct block {
    uint64_t addr;
    uint32_t at;       /* offset of the pointer in the parent block */
    uint32_t size;     /* bytes captured */
    uint64_t declared; /* bytes the parent said (> size when truncated) */
    unsigned char *before, *after;
    int before_ok, after_ok;
    struct block *child;
};

/* ---- RM_ALLOC parameter bytes by class ----
 *
 * The RM never uses NVOS21/NVOS64.paramsSize: it copies in as many bytes at pAllocParms as
 * the class's allocation parameter struct holds (alloc_free.c -> rmapiParamsCopyInit,
 * param_copy.c -> rmapiGetClassAllocParamSize, resource_desc.c, in open-gpu-kernel-modules
 * src/nvidia/src/kernel/rmapi/; the classes and their structs are listed in resource_list.h).
 * Real libcuda (580.159.04, CUDA 13) passes paramsSize 0 on every RM_ALLOC, so the recorder
 * captures pAllocParms by this table, as the RM reads it, whatever paramsSize says; only a
 * class missing here falls back to a non-zero paramsSize.
 *
 * Bytes measured by compiling NVIDIA's 580.142 SDK headers (sizeof of the struct that
 * resource_list.h names). "optional" (RS_OPTIONAL): pAllocParms may be NULL, and the RM then
 * reads nothing; the recorder never reads a NULL pointer for any class. Bytes 0 (RS_NONE):
 * the RM reads nothing. NV_MEMORY_ALLOCATION_PARAMS is 120 bytes on driver 535 (128 from 550
 * on, numaNode@120); rm_alloc_params_bytes() asks the driver version for that.
 *
 * The same table is bpf/gpuwatch.h's and gpuwatch/probes/layout.py's RM_ALLOC_PARAMS_BYTES;
 * tests/unit/test_trace_sizes.py parses this array and requires the two to agree. Keep one
 * {class, bytes, optional} entry per line. */
struct rm_alloc_class {
    uint32_t hclass;
    uint32_t bytes;
    int optional;
};
static const struct rm_alloc_class RM_ALLOC_PARAMS_BYTES[] = {
    {0x0000, 4, 1},   /* NV01_ROOT: NvHandle (the client handle asked for) */
    {0x0001, 4, 1},   /* NV01_ROOT_NON_PRIV: NvHandle */
    {0x0041, 4, 1},   /* NV01_ROOT_CLIENT: NvHandle */
    {0x0080, 56, 1},  /* NV01_DEVICE_0: NV0080_ALLOC_PARAMETERS */
    {0x2080, 4, 1},   /* NV20_SUBDEVICE_0: NV2080_ALLOC_PARAMETERS */
    {0x2081, 4, 1},   /* NV2081_BINAPI: NV2081_ALLOC_PARAMETERS */
    {0x0040, 128, 0}, /* NV01_MEMORY_LOCAL_USER: NV_MEMORY_ALLOCATION_PARAMS (size u64 @64) */
    {0x003E, 128, 0}, /* NV01_MEMORY_SYSTEM: NV_MEMORY_ALLOCATION_PARAMS */
    {0x50A0, 128, 0}, /* NV50_MEMORY_VIRTUAL: NV_MEMORY_ALLOCATION_PARAMS */
    {0x00C2, 24, 0},  /* NV01_MEMORY_LOCAL_PHYSICAL: NV_PHYSICAL_MEMORY_ALLOCATION_PARAMS */
    {0x0071, 40, 0},  /* NV01_MEMORY_SYSTEM_OS_DESCRIPTOR: NV_OS_DESC_MEMORY_ALLOCATION_PARAMS */
    {0x90F1, 56, 0},  /* FERMI_VASPACE_A: NV_VASPACE_ALLOCATION_PARAMETERS */
    {0x00F8, 48, 0},  /* NV_MEMORY_FABRIC: NV00F8_ALLOCATION_PARAMETERS */
    {0x00FD, 80, 0},  /* NV_MEMORY_MULTICAST_FABRIC: NV00FD_ALLOCATION_PARAMETERS */
    {0x00DE, 8, 0},   /* RM_USER_SHARED_DATA: NV00DE_ALLOC_PARAMETERS */
    {0x503C, 4, 1},   /* NV50_THIRD_PARTY_P2P: NV503C_ALLOC_PARAMETERS */
    {0xC8B5, 8, 1},   /* HOPPER_DMA_COPY_A: NVB0B5_ALLOCATION_PARAMETERS */
    {0x83DE, 12, 0},  /* GT200_DEBUGGER: NV83DE_ALLOC_PARAMETERS */
    {0xCB33, 4, 1},   /* NV_CONFIDENTIAL_COMPUTE: NV_CONFIDENTIAL_COMPUTE_ALLOC_PARAMS */
    {0xC661, 2, 1},   /* HOPPER_USERMODE_A: NV_HOPPER_USERMODE_A_PARAMS */
    {0xCBC0, 16, 1},  /* HOPPER_COMPUTE_A: NV_GR_ALLOCATION_PARAMETERS */
    {0xC86F, 368, 0}, /* HOPPER_CHANNEL_GPFIFO_A: NV_CHANNEL_ALLOC_PARAMS */
    {0xA06C, 20, 0},  /* KEPLER_CHANNEL_GROUP_A: NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS */
    {0x9067, 12, 0},  /* FERMI_CONTEXT_SHARE_A: NV_CTXSHARE_ALLOCATION_PARAMETERS */
    {0x90E6, 0, 0},   /* GF100_SUBDEVICE_MASTER: no parameters */
    {0x0079, 24, 0},  /* NV01_EVENT_OS_EVENT: NV0005_ALLOC_PARAMETERS (RS_REQUIRED, 4 x u32 + NvP64) */
};

#define NV_MEMORY_ALLOCATION_PARAMS_535_BYTES 120u

static void driver_version(char *buf, size_t cap, int use_nvml);

/* The driver's major version from /proc/driver/nvidia/version (0: none there, as on the
 * simulated node), read once. */
static int driver_major(void)
{
    static int cached = -1;
    int major = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
    if (major < 0) {
        char version[96];
        driver_version(version, sizeof(version), 0);
        major = atoi(version);
        __atomic_store_n(&cached, major, __ATOMIC_RELEASE);
    }
    return major;
}

/* How many bytes the RM reads at pAllocParms for `hclass` (-1: a class not in the table). */
static int rm_alloc_params_bytes(uint32_t hclass)
{
    for (size_t i = 0; i < sizeof(RM_ALLOC_PARAMS_BYTES) / sizeof(RM_ALLOC_PARAMS_BYTES[0]); i++) {
        const struct rm_alloc_class *c = &RM_ALLOC_PARAMS_BYTES[i];
        if (c->hclass != hclass)
            continue;
        if (c->bytes == 128 && driver_major() > 0 && driver_major() < 550)
            return (int)NV_MEMORY_ALLOCATION_PARAMS_535_BYTES;
        return (int)c->bytes;
    }
    return -1;
}

/* Where a parameter struct of escape `nr` and `size` bytes points: the offsets of the
 * pointer (ptr_at) and of the u32 byte count of the block it points to (size_at). For
 * RM_ALLOC the byte count is only a fallback (see RM_ALLOC_PARAMS_BYTES); class_at is the
 * offset of hClass there, -1 elsewhere. */
static int nested_rule(unsigned nr, uint32_t size, uint32_t *ptr_at, uint32_t *size_at, int *class_at)
{
    *class_at = -1;
    if (nr == NV_ESC_RM_ALLOC && size == 32) { /* NVOS21 */
        *ptr_at = 16;
        *size_at = 24;
        *class_at = 12;
        return 1;
    }
    if (nr == NV_ESC_RM_ALLOC && size == 48) { /* NVOS64 */
        *ptr_at = 16;
        *size_at = 32;
        *class_at = 12;
        return 1;
    }
    if (nr == NV_ESC_RM_CONTROL && size == 32) { /* NVOS54 */
        *ptr_at = 16;
        *size_at = 24;
        return 1;
    }
    if (nr == NV_ESC_IOCTL_XFER_CMD && size == 16) { /* nv_ioctl_xfer_t */
        *ptr_at = 8;
        *size_at = 4;
        return 1;
    }
    return 0;
}

/* Fill `b`'s child from its before image (escape nr); pool is scratch for the images.
 * Sets *size_unknown when an RM_ALLOC points at parameters whose size neither the class
 * table nor paramsSize gives (nothing captured). */
static void plan_nested(struct block *b, unsigned nr, struct block *nodes, int depth, unsigned char **pool,
                        int *size_unknown)
{
    uint32_t ptr_at, size_at;
    int class_at;
    b->child = NULL;
    if (!b->before_ok || depth >= 2 || !nested_rule(nr, b->size, &ptr_at, &size_at, &class_at))
        return;
    uint64_t addr = get_u64(b->before, ptr_at);
    uint32_t declared = get_u32(b->before, size_at);
    if (class_at >= 0) { /* RM_ALLOC: the RM reads what the class says, paramsSize only if unknown */
        int by_class = rm_alloc_params_bytes(get_u32(b->before, (size_t)class_at));
        if (by_class >= 0)
            declared = (uint32_t)by_class;
        else if (declared == 0 && addr != 0)
            *size_unknown = 1;
    }
    if (addr == 0 || declared == 0)
        return;
    struct block *c = &nodes[depth];
    memset(c, 0, sizeof(*c));
    c->addr = addr;
    c->at = ptr_at;
    c->declared = declared;
    c->size = declared > NESTED_CAP_BYTES ? NESTED_CAP_BYTES : declared;
    c->before = *pool;
    c->after = *pool + c->size;
    *pool += 2 * (size_t)c->size;
    c->before_ok = read_user(c->before, c->addr, c->size) == 0;
    b->child = c;
    if (nr == NV_ESC_IOCTL_XFER_CMD) /* the inner command's own nested block */
        plan_nested(c, get_u32(b->before, 0) & 0xffu, nodes, depth + 1, pool, size_unknown);
}

static void read_after(struct block *b)
{
    for (; b; b = b->child)
        b->after_ok = b->before_ok && read_user(b->after, b->addr, b->size) == 0;
}

static void put_images(struct out *o, const struct block *b)
{
    puts_(o, "\"before\": \"");
    if (b->before_ok)
        put_hex(o, b->before, b->size);
    puts_(o, "\", \"after\": \"");
    if (b->after_ok)
        put_hex(o, b->after, b->size);
    puts_(o, "\"");
}

static void put_nested(struct out *o, const struct block *c)
{
    puts_(o, "[");
    if (c) {
        putf(o, "{\"at\": %u, \"size\": %u, ", c->at, c->before_ok ? c->size : 0);
        put_images(o, c);
        if (c->size < c->declared)
            putf(o, ", \"truncated\": true, \"declared_size\": %llu", (unsigned long long)c->declared);
        if (!c->before_ok)
            puts_(o, ", \"unreadable\": true");
        puts_(o, ", \"nested\": ");
        put_nested(o, c->child);
        puts_(o, "}");
    }
    puts_(o, "]");
}

/* Parameter sizes of the nvidia-uvm ioctls CUDA issues whose layout does not depend on
 * UVM_MAX_GPUS or the driver branch (kernel-open/nvidia-uvm/uvm_ioctl.h and
 * uvm_linux_ioctl.h; sizes computed from the field lists with 8-byte-aligned NvU64).
 * MAP_EXTERNAL_ALLOCATION is captured by its head only: base u64 @0, length u64 @8,
 * offset u64 @16 come before perGpuAttributes[UVM_MAX_GPUS] (535 to 595 alike), so they
 * are the same on every branch; the rest (attributes, gpuAttributesCount, rmCtrlFd,
 * hClient, hMemory, rmStatus) is not captured. */
static int uvm_param_size(unsigned long cmd)
{
    switch (cmd) {
    case 0x30000001: return 16; /* UVM_INITIALIZE: flags u64, rmStatus */
    case 0x30000002: return 0;  /* UVM_DEINITIALIZE: no parameters */
    case 23: return 16;         /* CREATE_RANGE_GROUP */
    case 24: return 16;         /* DESTROY_RANGE_GROUP */
    case 25: return 32;         /* REGISTER_GPU_VASPACE */
    case 26: return 20;         /* UNREGISTER_GPU_VASPACE */
    case 27: return 56;         /* REGISTER_CHANNEL */
    case 28: return 28;         /* UNREGISTER_CHANNEL */
    case 29: return 36;         /* ENABLE_PEER_ACCESS */
    case 30: return 36;         /* DISABLE_PEER_ACCESS */
    case 31: return 32;         /* SET_RANGE_GROUP */
    case 33: return 24;         /* MAP_EXTERNAL_ALLOCATION: its head only (see above) */
    case 34: return 24;         /* FREE: base, length, rmStatus */
    case 37: return 40;         /* REGISTER_GPU */
    case 38: return 20;         /* UNREGISTER_GPU */
    case 39: return 8;          /* PAGEABLE_MEM_ACCESS */
    case 43: return 24;         /* UNSET_PREFERRED_LOCATION */
    case 44: return 24;         /* ENABLE_READ_DUPLICATION */
    case 45: return 24;         /* DISABLE_READ_DUPLICATION */
    case 46: return 40;         /* SET_ACCESSED_BY */
    case 47: return 40;         /* UNSET_ACCESSED_BY */
    case 66: return 40;         /* UNMAP_EXTERNAL */
    case 69: return 4;          /* CLEAN_UP_ZOMBIE_RESOURCES */
    case 70: return 24;         /* PAGEABLE_MEM_ACCESS_ON_GPU */
    case 71: return 24;         /* POPULATE_PAGEABLE */
    case 72: return 24;         /* VALIDATE_VA_RANGE */
    case 73: return 24;         /* CREATE_EXTERNAL_RANGE */
    case 75: return 8;          /* MM_INITIALIZE: uvmFd, rmStatus */
    default: return -1;
    }
}

static int record_ioctl(int fd, unsigned long request, void *arg, int (*call)(int, unsigned long, void *))
{
    uint32_t cmd = (uint32_t)request;
    int uvm = is_uvm_fd(fd);
    int size;
    if (uvm)
        size = uvm_param_size(request);
    else
        size = (int)IOC_SIZE(cmd);
    uint32_t top_size = size > 0 ? (uint32_t)size : 0;
    /* images: top (2 x 16 KiB at most) + two nested levels (2 x 64 KiB each) */
    size_t raw_cap = 2 * (size_t)top_size + 4 * (size_t)NESTED_CAP_BYTES;
    size_t text_cap = 2 * raw_cap + 4096;
    char *mem = scratch(raw_cap + text_cap);
    if (!mem)
        return call(fd, request, arg);
    unsigned char *pool = (unsigned char *)mem;
    struct block top, nodes[2];
    memset(&top, 0, sizeof(top));
    top.addr = (uint64_t)(uintptr_t)arg;
    top.size = top_size;
    top.declared = top_size;
    top.before = pool;
    top.after = pool + top_size;
    pool += 2 * (size_t)top_size;
    top.before_ok = read_user(top.before, top.addr, top_size) == 0;
    int params_size_unknown = 0;
    if (!uvm && IOC_TYPE(cmd) == NV_MAGIC)
        plan_nested(&top, IOC_NR(cmd), nodes, 0, &pool, &params_size_unknown);
    int ret = call(fd, request, arg);
    int err = errno;
    uint64_t t = mono_ns();
    read_after(&top);

    struct out o = {mem + raw_cap, 0, text_cap, 0};
    putf(&o, "{\"ev\": \"ioctl\", \"t_ns\": %llu, \"tid\": %ld, \"fd\": %d, \"cmd\": %u, \"ret\": %d, \"errno\": %d, ",
         (unsigned long long)t, tid(), fd, cmd, ret, ret < 0 ? err : 0);
    put_images(&o, &top);
    if (uvm && size < 0)
        puts_(&o, ", \"size_unknown\": true");
    else if (top_size && !top.before_ok)
        puts_(&o, ", \"unreadable\": true");
    if (params_size_unknown)
        puts_(&o, ", \"params_size_unknown\": true");
    puts_(&o, ", \"nested\": ");
    put_nested(&o, top.child);
    puts_(&o, "}");
    emit(&o);
    errno = err;
    return ret;
}

/* ---- NVML (checkpoints and the header's GPU list) ---- */

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvml_memory;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvml_process_info; /* _v2 and _v3 layout */

static struct {
    int tried, ok;
    nvmlReturn_t (*init)(void);
    nvmlReturn_t (*count)(unsigned int *);
    nvmlReturn_t (*handle)(unsigned int, nvmlDevice_t *);
    nvmlReturn_t (*minor)(nvmlDevice_t, unsigned int *);
    nvmlReturn_t (*uuid)(nvmlDevice_t, char *, unsigned int);
    nvmlReturn_t (*name)(nvmlDevice_t, char *, unsigned int);
    nvmlReturn_t (*memory)(nvmlDevice_t, nvml_memory *);
    nvmlReturn_t (*procs)(nvmlDevice_t, unsigned int *, nvml_process_info *);
    nvmlReturn_t (*driver_version)(char *, unsigned int);
    nvmlReturn_t (*cuda_version)(int *);
} nvml;

/* Load and initialise NVML once; it stays initialised for the life of the process. */
static int nvml_ready(void)
{
    if (nvml.tried)
        return nvml.ok;
    nvml.tried = 1;
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return 0;
#define NVSYM(field, name) (*(void **)&nvml.field = dlsym(lib, name))
    NVSYM(init, "nvmlInit_v2");
    NVSYM(count, "nvmlDeviceGetCount_v2");
    NVSYM(handle, "nvmlDeviceGetHandleByIndex_v2");
    NVSYM(minor, "nvmlDeviceGetMinorNumber");
    NVSYM(uuid, "nvmlDeviceGetUUID");
    NVSYM(name, "nvmlDeviceGetName");
    NVSYM(memory, "nvmlDeviceGetMemoryInfo");
    if (!NVSYM(procs, "nvmlDeviceGetComputeRunningProcesses_v3"))
        NVSYM(procs, "nvmlDeviceGetComputeRunningProcesses_v2");
    NVSYM(driver_version, "nvmlSystemGetDriverVersion");
    if (!NVSYM(cuda_version, "nvmlSystemGetCudaDriverVersion_v2"))
        NVSYM(cuda_version, "nvmlSystemGetCudaDriverVersion");
#undef NVSYM
    if (!nvml.init || !nvml.count || !nvml.handle || nvml.init() != 0)
        return 0;
    nvml.ok = 1;
    return 1;
}

static unsigned nvml_device_count(void)
{
    unsigned n = 0;
    if (!nvml_ready() || nvml.count(&n) != 0)
        return 0;
    return n;
}

static void put_gpu_identity(struct out *o, nvmlDevice_t d)
{
    unsigned minor = 0;
    char uuid[96] = "";
    if (!nvml.minor || nvml.minor(d, &minor) != 0)
        minor = 0;
    if (nvml.uuid)
        (void)nvml.uuid(d, uuid, sizeof(uuid));
    uuid[sizeof(uuid) - 1] = 0;
    putf(o, "\"minor\": %u, \"uuid\": ", minor);
    put_json_str(o, uuid, strlen(uuid));
}

static void put_header_gpus(struct out *o)
{
    puts_(o, "[");
    unsigned n = nvml_device_count();
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        if (nvml.handle(i, &d) != 0)
            continue;
        char name[128] = "";
        nvml_memory m = {0, 0, 0};
        if (nvml.name)
            (void)nvml.name(d, name, sizeof(name));
        name[sizeof(name) - 1] = 0;
        if (nvml.memory)
            (void)nvml.memory(d, &m);
        puts_(o, i ? ", {" : "{");
        put_gpu_identity(o, d);
        puts_(o, ", \"name\": ");
        put_json_str(o, name, strlen(name));
        putf(o, ", \"memory_total_bytes\": %llu}", m.total);
    }
    puts_(o, "]");
}

/* NVML's used bytes of this process on d, or -1 when NVML does not list it */
static long long process_used_bytes(nvmlDevice_t d)
{
    if (!nvml.procs)
        return -1;
    nvml_process_info infos[256];
    unsigned count = 256;
    if (nvml.procs(d, &count, infos) != 0)
        return -1;
    unsigned pid = (unsigned)getpid();
    for (unsigned k = 0; k < count && k < 256; k++)
        if (infos[k].pid == pid)
            return (long long)infos[k].usedGpuMemory;
    return -1;
}

static void put_checkpoint_gpus(struct out *o)
{
    puts_(o, "[");
    unsigned n = nvml_device_count();
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        if (nvml.handle(i, &d) != 0)
            continue;
        nvml_memory m = {0, 0, 0};
        if (nvml.memory)
            (void)nvml.memory(d, &m);
        long long used = process_used_bytes(d);
        puts_(o, i ? ", {" : "{");
        put_gpu_identity(o, d);
        if (used < 0)
            puts_(o, ", \"process_used_bytes\": null");
        else
            putf(o, ", \"process_used_bytes\": %lld", used);
        putf(o, ", \"device_used_bytes\": %llu}", m.used);
    }
    puts_(o, "]");
}

/* ---- header ---- */

/* The driver version from /proc/driver/nvidia/version ("NVRM version: ... 550.54.14 ..."),
 * else NVML's; into buf, "" when unknown. */
static void driver_version(char *buf, size_t cap, int use_nvml)
{
    buf[0] = 0;
    int fd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/driver/nvidia/version", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        char text[512];
        ssize_t n = read(fd, text, sizeof(text) - 1);
        sys_close(fd);
        text[n > 0 ? n : 0] = 0;
        char *save = NULL;
        for (char *tok = strtok_r(text, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) {
            int dots = 0, digits = 1;
            for (char *c = tok; *c; c++) {
                if (*c == '.')
                    dots++;
                else if (*c < '0' || *c > '9')
                    digits = 0;
            }
            if (digits && dots >= 1 && tok[0] != '.') {
                snprintf(buf, cap, "%s", tok);
                return;
            }
        }
    }
    if (use_nvml && nvml_ready() && nvml.driver_version && nvml.driver_version(buf, (unsigned)cap) != 0)
        buf[0] = 0;
    buf[cap - 1] = 0;
}

static void put_argv(struct out *o)
{
    puts_(o, "[");
    int fd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        char text[4096];
        ssize_t n = read(fd, text, sizeof(text));
        sys_close(fd);
        size_t start = 0;
        int first = 1;
        for (ssize_t i = 0; i < n; i++) {
            if (text[i] == 0) {
                if (!first)
                    puts_(o, ", ");
                put_json_str(o, text + start, (size_t)i - start);
                first = 0;
                start = (size_t)i + 1;
            }
        }
    }
    puts_(o, "]");
}

static void put_rfc3339_now(struct out *o)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    putf(o, "\"%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ\"", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
         tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000);
}

/* The header line (NVML is asked here, outside any lock of ours: a program thread inside
 * NVML may be waiting for our write lock). */
static void build_header(struct out *o, int use_nvml)
{
    char host[256] = "";
    gethostname(host, sizeof(host) - 1);
    char version[96];
    driver_version(version, sizeof(version), use_nvml);
    int cuda = 0;
    int have_cuda = use_nvml && nvml_ready() && nvml.cuda_version && nvml.cuda_version(&cuda) == 0;
    puts_(o, "{\"format\": \"gpuwatch-ioctl-trace\", \"version\": 1, \"recorded_at\": ");
    put_rfc3339_now(o);
    puts_(o, ", \"host\": ");
    put_json_str(o, host, strlen(host));
    putf(o, ", \"pid\": %d, \"argv\": ", (int)getpid());
    put_argv(o);
    puts_(o, ", \"driver_version\": ");
    if (version[0])
        put_json_str(o, version, strlen(version));
    else
        puts_(o, "null");
    if (have_cuda)
        putf(o, ", \"cuda_driver_version\": %d", cuda);
    else
        puts_(o, ", \"cuda_driver_version\": null");
    /* RM_ALLOC parameters captured by class (RM_ALLOC_PARAMS_BYTES), not by paramsSize alone */
    puts_(o, ", \"alloc_params\": \"by-class\"");
    putf(o, ", \"simulated\": %s, \"gpus\": ", getenv("GPUWATCH_SIM_STATE") ? "true" : "false");
    if (use_nvml)
        put_header_gpus(o);
    else
        puts_(o, "[]");
    puts_(o, "}\n");
}

/* Write the header, an "open" line for every tracked fd this process inherited (from
 * the parent it forked from, or open across the exec that started it), then the lines that waited for the header; under g_write_lock. */
static void write_header_locked(struct out *o)
{
    write_line_locked(o);
    uint64_t t = mono_ns();
    for (int fd = 0; fd < MAX_TRACKED_FD && g_inherited_fds && !g_failed; fd++) {
        if (!tracked(fd))
            continue;
        o->len = 0;
        o->overflow = 0;
        putf(o, "{\"ev\": \"open\", \"t_ns\": %llu, \"tid\": %ld, \"path\": ", (unsigned long long)t, tid());
        put_json_str(o, fd_path(fd), strlen(fd_path(fd)));
        putf(o, ", \"flags\": %d, \"fd\": %d, \"inherited\": true}\n", O_RDWR, fd);
        write_line_locked(o);
    }
    pending_flush_locked();
    __atomic_store_n(&g_trace_created, 1, __ATOMIC_RELEASE);
}

/* Create the trace file with its header (NVML is asked first, outside our lock). */
static void ensure_header(void)
{
    if (__atomic_load_n(&g_trace_created, __ATOMIC_ACQUIRE))
        return;
    int busy = t_busy;
    t_busy = 1;
    char lines[32768];
    struct out o = {lines, 0, sizeof(lines), 0};
    build_header(&o, 1);
    pthread_mutex_lock(&g_write_lock);
    if (!g_trace_created && !g_finished)
        write_header_locked(&o);
    pthread_mutex_unlock(&g_write_lock);
    t_busy = busy;
}

/* ---- checkpoints ---- */

API void gwrec_checkpoint(const char *name)
{
    if (!g_enabled || t_busy || g_finished || g_failed)
        return;
    int saved = errno;
    t_caller = __builtin_return_address(0);
    t_busy = 1;
    struct out o = line_out(65536);
    putf(&o, "{\"ev\": \"checkpoint\", \"t_ns\": %llu, \"name\": ", (unsigned long long)mono_ns());
    put_json_str(&o, name ? name : "", name ? strlen(name) : 0);
    puts_(&o, ", \"nvml\": ");
    put_checkpoint_gpus(&o);
    puts_(&o, "}");
    emit(&o);
    t_busy = 0;
    errno = saved;
}

/* ---- process lifecycle ---- */

/* The exit line. Registered in our constructor, which runs before the program's entry
 * point registers the loader's destructor pass, so this runs after every library's
 * destructors (libcuda's teardown included): the exit line is the last line. */
static void on_exit_status(int status, void *arg)
{
    (void)arg;
    if (!g_enabled)
        return;
    t_busy = 1; /* a signal handler's ioctl from here on passes through (we take the lock) */
    if (g_pending && !g_trace_created) {
        /* only NVML touched the GPU: header without NVML, whose destructors have run */
        char lines[32768];
        struct out header = {lines, 0, sizeof(lines), 0};
        t_busy = 1;
        build_header(&header, 0);
        pthread_mutex_lock(&g_write_lock);
        if (!g_trace_created && !g_finished)
            write_header_locked(&header);
        pthread_mutex_unlock(&g_write_lock);
    }
    pthread_mutex_lock(&g_write_lock);
    if (g_trace_created && !g_finished && !g_failed) {
        char text[128];
        struct out o = {text, 0, sizeof(text), 0};
        putf(&o, "{\"ev\": \"exit\", \"t_ns\": %llu, \"status\": %d}\n", (unsigned long long)mono_ns(), status);
        write_line_locked(&o);
    }
    g_finished = 1;
    pthread_mutex_unlock(&g_write_lock);
}

static void atfork_child(void)
{
    g_pid = getpid();
    t_tid = 0; /* the forking thread is the child's main thread, with a new id */
    pthread_mutex_init(&g_write_lock, NULL);
    pthread_mutex_init(&g_path_lock, NULL);
    if (g_trace_fd >= 0)
        sys_close(g_trace_fd);
    g_trace_fd = -1;
    g_trace_path[0] = 0;
    g_trace_created = 0;
    g_inherited_fds = 1;
    if (g_pending) /* the parent's lines */
        syscall(SYS_munmap, g_pending, g_pending_cap);
    g_pending = NULL;
    g_pending_len = g_pending_cap = 0;
    /* the child starts a file of its own at its first event */
}

/* Device fds open across the exec that started this image (no O_CLOEXEC): tracked too. */
static void track_inherited_fds(void)
{
    t_busy = 1;
    DIR *dir = opendir("/proc/self/fd");
    if (dir) {
        int own = dirfd(dir);
        struct dirent *e;
        while ((e = readdir(dir)) != NULL) {
            char *end;
            long fd = strtol(e->d_name, &end, 10);
            if (*end || end == e->d_name || fd < 0 || fd == own || fd >= MAX_TRACKED_FD)
                continue;
            char link[64], target[PATH_CAP], nbuf[PATH_CAP];
            snprintf(link, sizeof(link), "/proc/self/fd/%ld", fd);
            ssize_t n = readlink(link, target, sizeof(target) - 1);
            if (n <= 0)
                continue;
            target[n] = 0;
            const char *norm = normalized(target, nbuf, sizeof(nbuf));
            int idx = norm ? path_index_of(norm) : -1;
            if (idx >= 0) {
                set_fd((int)fd, idx);
                g_inherited_fds = 1;
            }
        }
        closedir(dir);
    }
    t_busy = 0;
}

__attribute__((constructor)) static void gwrec_start(void)
{
    g_pid = getpid();
    const char *dir = getenv("GPUWATCH_REC_DIR");
    const char *prefix = getenv("GPUWATCH_REC_PREFIX");
    if (prefix && *prefix && strlen(prefix) < sizeof(g_prefix)) {
        snprintf(g_prefix, sizeof(g_prefix), "%s", prefix);
        g_prefix_len = strlen(g_prefix);
    }
    if (!dir || !*dir) {
        warn("GPUWATCH_REC_DIR is not set: not recording");
        return;
    }
    if (strlen(dir) >= sizeof(g_dir)) {
        warn("GPUWATCH_REC_DIR is too long: not recording");
        return;
    }
    if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
        warn("cannot create GPUWATCH_REC_DIR: not recording");
        return;
    }
    /* absolute, so a program that changes directory still writes here */
    char resolved[PATH_MAX];
    if (!realpath(dir, resolved) || strlen(resolved) >= sizeof(g_dir)) {
        warn("cannot resolve GPUWATCH_REC_DIR: not recording");
        return;
    }
    snprintf(g_dir, sizeof(g_dir), "%s", resolved);
    pthread_key_create(&g_buf_key, free_thread_buffer);
    pthread_atfork(NULL, NULL, atfork_child);
    on_exit(on_exit_status, NULL);
    g_enabled = 1;
    track_inherited_fds();
}

/* ---- interposed calls ---- */

/* who made the call (not updated for the recorder's own calls, e.g. into NVML) */
#define NOTE_CALLER()                                                                    \
    do {                                                                                 \
        if (!t_busy)                                                                     \
            t_caller = __builtin_return_address(0);                                      \
    } while (0)

static int open_mode_needed(int flags)
{
#ifdef O_TMPFILE /* glibc 2.19+ */
    if ((flags & O_TMPFILE) == O_TMPFILE)
        return 1;
#endif
    return (flags & O_CREAT) != 0;
}

#define OPEN_BODY(realcall, dirfd)                                                       \
    int saved_errno = errno;                                                             \
    int fd = realcall;                                                                   \
    int err = errno;                                                                     \
    after_open(dirfd, path, flags, fd, err);                                             \
    errno = fd < 0 ? err : saved_errno;                                                  \
    return fd

API int open(const char *path, int flags, ...)
{
    NOTE_CALLER();
    mode_t mode = 0;
    if (open_mode_needed(flags)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    OPEN_BODY(REAL(open, open_fn)(path, flags, mode), AT_FDCWD);
}

API int open64(const char *path, int flags, ...)
{
    NOTE_CALLER();
    mode_t mode = 0;
    if (open_mode_needed(flags)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    OPEN_BODY(REAL(open64, open_fn)(path, flags, mode), AT_FDCWD);
}

API int openat(int dirfd, const char *path, int flags, ...)
{
    NOTE_CALLER();
    mode_t mode = 0;
    if (open_mode_needed(flags)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    OPEN_BODY(REAL(openat, openat_fn)(dirfd, path, flags, mode), dirfd);
}

API int openat64(int dirfd, const char *path, int flags, ...)
{
    NOTE_CALLER();
    mode_t mode = 0;
    if (open_mode_needed(flags)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    OPEN_BODY(REAL(openat64, openat_fn)(dirfd, path, flags, mode), dirfd);
}

/* the _FORTIFY_SOURCE entry points (no mode argument) */
API int __open_2(const char *path, int flags)
{
    NOTE_CALLER();
    OPEN_BODY(REAL(open, open_fn)(path, flags), AT_FDCWD);
}

API int __open64_2(const char *path, int flags)
{
    NOTE_CALLER();
    OPEN_BODY(REAL(open64, open_fn)(path, flags), AT_FDCWD);
}

API int __openat_2(int dirfd, const char *path, int flags)
{
    NOTE_CALLER();
    OPEN_BODY(REAL(openat, openat_fn)(dirfd, path, flags), dirfd);
}

API int __openat64_2(int dirfd, const char *path, int flags)
{
    NOTE_CALLER();
    OPEN_BODY(REAL(openat64, openat_fn)(dirfd, path, flags), dirfd);
}

API int close(int fd)
{
    NOTE_CALLER();
    int saved_errno = errno;
    int was_tracked = tracked(fd);
    int ret = REAL(close, close_fn)(fd);
    int err = errno;
    /* Linux releases the fd even when close reports an error (EINTR, EIO) */
    if (ret == 0 || err != EBADF) {
        if (was_tracked)
            forget_fd(fd);
        trace_fd_lost(fd);
    }
    errno = ret < 0 ? err : saved_errno;
    return ret;
}

#ifdef SYS_close_range
API int close_range(unsigned int first, unsigned int last, int flags)
{
    NOTE_CALLER();
    int saved_errno = errno;
    close_range_fn fn = REAL(close_range, close_range_fn);
    int ret = fn ? fn(first, last, flags) : (int)syscall(SYS_close_range, first, last, flags);
    int err = errno;
    if (ret == 0 && !(flags & 4 /* CLOSE_RANGE_CLOEXEC */)) {
        unsigned hi = last < (unsigned)MAX_TRACKED_FD - 1 ? last : (unsigned)MAX_TRACKED_FD - 1;
        for (unsigned fd = first; fd <= hi; fd++)
            forget_fd((int)fd);
        if (g_trace_fd >= 0 && (unsigned)g_trace_fd >= first && (unsigned)g_trace_fd <= last)
            g_trace_fd = -1;
    }
    errno = ret < 0 ? err : saved_errno;
    return ret;
}
#endif

API int dup(int oldfd)
{
    NOTE_CALLER();
    int saved_errno = errno;
    int fd = REAL(dup, dup_fn)(oldfd);
    int err = errno;
    after_dup(oldfd, fd);
    errno = fd < 0 ? err : saved_errno;
    return fd;
}

API int dup2(int oldfd, int newfd)
{
    NOTE_CALLER();
    int saved_errno = errno;
    int fd = REAL(dup2, dup2_fn)(oldfd, newfd);
    int err = errno;
    if (fd >= 0) {
        if (fd != oldfd)
            trace_fd_lost(fd);
        after_dup(oldfd, fd);
    }
    errno = fd < 0 ? err : saved_errno;
    return fd;
}

API int dup3(int oldfd, int newfd, int flags)
{
    NOTE_CALLER();
    int saved_errno = errno;
    int fd = REAL(dup3, dup3_fn)(oldfd, newfd, flags);
    int err = errno;
    if (fd >= 0) {
        trace_fd_lost(fd);
        after_dup(oldfd, fd);
    }
    errno = fd < 0 ? err : saved_errno;
    return fd;
}

static int fcntl_common(fcntl_fn fn, int fd, int cmd, void *arg)
{
    int saved_errno = errno;
    int ret = fn(fd, cmd, arg);
    int err = errno;
    if ((cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) && ret >= 0)
        after_dup(fd, ret);
    errno = ret < 0 ? err : saved_errno;
    return ret;
}

API int fcntl(int fd, int cmd, ...)
{
    NOTE_CALLER();
    va_list ap;
    va_start(ap, cmd);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    return fcntl_common(REAL(fcntl, fcntl_fn), fd, cmd, arg);
}

API int fcntl64(int fd, int cmd, ...)
{
    NOTE_CALLER();
    va_list ap;
    va_start(ap, cmd);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    fcntl_fn fn = REAL(fcntl64, fcntl_fn);
    return fcntl_common(fn ? fn : REAL(fcntl, fcntl_fn), fd, cmd, arg);
}

static int real_ioctl_call(int fd, unsigned long request, void *arg)
{
    return REAL(ioctl, ioctl_fn)(fd, request, arg);
}

API int ioctl(int fd, unsigned long request, ...)
{
    NOTE_CALLER();
    va_list ap;
    va_start(ap, request);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    if (!g_enabled || !tracked(fd) || t_busy || g_finished || g_failed)
        return real_ioctl_call(fd, request, arg);
    int saved_errno = errno;
    t_busy = 1;
    int ret = record_ioctl(fd, request, arg, real_ioctl_call);
    int err = errno;
    t_busy = 0;
    errno = ret < 0 ? err : saved_errno;
    return ret;
}

static void *mmap_common(mmap_fn fn, void *addr, size_t length, int prot, int flags, int fd, off_t offset)
{
    if (!g_enabled || !tracked(fd) || t_busy || g_finished || g_failed)
        return fn(addr, length, prot, flags, fd, offset);
    int saved_errno = errno;
    void *ret = fn(addr, length, prot, flags, fd, offset);
    int err = errno;
    t_busy = 1;
    struct out o = line_out(512);
    putf(&o,
         "{\"ev\": \"mmap\", \"t_ns\": %llu, \"fd\": %d, \"length\": %zu, \"prot\": %d, \"flags\": %d, "
         "\"offset\": %lld, \"ret_ok\": %s}",
         (unsigned long long)mono_ns(), fd, length, prot, flags, (long long)offset,
         ret == MAP_FAILED ? "false" : "true");
    emit(&o);
    t_busy = 0;
    errno = ret == MAP_FAILED ? err : saved_errno;
    return ret;
}

API void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t offset)
{
    NOTE_CALLER();
    return mmap_common(REAL(mmap, mmap_fn), addr, length, prot, flags, fd, offset);
}

API void *mmap64(void *addr, size_t length, int prot, int flags, int fd, off_t offset)
{
    NOTE_CALLER();
    mmap_fn fn = REAL(mmap64, mmap_fn);
    return mmap_common(fn ? fn : REAL(mmap, mmap_fn), addr, length, prot, flags, fd, offset);
}
