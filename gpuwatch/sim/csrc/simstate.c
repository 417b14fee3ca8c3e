/*
 * Shared-state helpers compiled into both libnvidia-ml.so.1 and libcuda.so.1 (hidden
 * symbols). See simstate.h for the layout and the locking/liveness rules.
 */
#define _GNU_SOURCE
#include "simstate.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#define HIDDEN __attribute__((visibility("hidden")))

static pthread_mutex_t g_local_lock = PTHREAD_MUTEX_INITIALIZER;

HIDDEN const char *sim_state_path(void)
{
    const char *p = getenv("GPUWATCH_SIM_STATE");
    return (p && *p) ? p : "/dev/shm/gpuwatch-sim-default";
}

HIDDEN int sim_open(const char *path, struct sim_handle *out)
{
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct stat st;
    if (fstat(fd, &st) < 0 || (size_t)st.st_size < sizeof(struct sim_header)) {
        close(fd); /* no locks were taken on this descriptor yet */
        return -EINVAL;
    }
    void *m = mmap(NULL, sizeof(struct sim_header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        int e = errno;
        close(fd);
        return -e;
    }
    struct sim_header *hdr = m;
    if (hdr->magic != SIM_MAGIC || hdr->layout_version != SIM_LAYOUT_VERSION) {
        munmap(m, sizeof(struct sim_header));
        close(fd);
        return -EPROTO;
    }
    out->fd = fd;
    out->hdr = hdr;
    return 0;
}

HIDDEN int sim_reopen(const char *path, struct sim_handle *h, int unmap_old)
{
    struct sim_handle fresh;
    int rc = sim_open(path, &fresh);
    if (rc < 0)
        return rc;
    struct sim_handle old = *h;
    *h = fresh;
    if (unmap_old)
        munmap(old.hdr, sizeof(struct sim_header));
    close(old.fd);
    return 0;
}

HIDDEN int sim_is_current(const char *path, const struct sim_handle *h)
{
    struct stat a, b;
    if (stat(path, &a) < 0 || fstat(h->fd, &b) < 0)
        return 0;
    return a.st_ino == b.st_ino && a.st_dev == b.st_dev;
}

HIDDEN void sim_after_fork_child(void)
{
    pthread_mutex_init(&g_local_lock, NULL);
}

HIDDEN void sim_lock(struct sim_handle *h, int exclusive)
{
    pthread_mutex_lock(&g_local_lock);
    while (flock(h->fd, exclusive ? LOCK_EX : LOCK_SH) < 0 && errno == EINTR) {
    }
}

HIDDEN void sim_unlock(struct sim_handle *h)
{
    flock(h->fd, LOCK_UN);
    pthread_mutex_unlock(&g_local_lock);
}

HIDDEN uint64_t sim_realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

HIDDEN uint64_t sim_monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static uint64_t read_start_ticks(void)
{
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* comm may contain spaces */
    if (!p)
        return 0;
    p++;
    /* after ')' come fields 3.. ; starttime is field 22 */
    int field = 2;
    char *save = NULL;
    for (char *tok = strtok_r(p, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
        field++;
        if (field == 22)
            return strtoull(tok, NULL, 10);
    }
    return 0;
}

HIDDEN void sim_self_identity(struct sim_self *out)
{
    struct stat st;
    out->ns_pid = (int32_t)getpid();
    out->pidns_ino = stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
    out->start_ticks = read_start_ticks();
}

static int is_self(const struct sim_proc *p, const struct sim_self *self)
{
    return self && p->ns_pid == self->ns_pid && p->pidns_ino == self->pidns_ino &&
           p->start_ticks == self->start_ticks;
}

HIDDEN int sim_slot_owner(struct sim_handle *h, int slot, const struct sim_self *self)
{
    struct sim_proc *p = &h->hdr->procs[slot];
    if (!__atomic_load_n(&p->in_use, __ATOMIC_ACQUIRE))
        return -1;
    if (is_self(p, self))
        return (int)getpid();
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(SIM_LIVE_LOCK_BASE + (uint64_t)slot);
    fl.l_len = 1;
    if (fcntl(h->fd, F_GETLK, &fl) < 0)
        return 0; /* cannot tell: treat as alive, pid unknown */
    if (fl.l_type == F_UNLCK)
        return -1;
    return fl.l_pid > 0 ? (int)fl.l_pid : 0;
}

HIDDEN void sim_credit_sample(struct sim_proc *p, int dev, uint32_t busy_us, uint64_t now_ns, uint64_t period_ns)
{
    if (!busy_us || !period_ns)
        return;
    uint64_t k = now_ns / period_ns;
    sim_bucket_t *b = &p->samples[dev][k % SIM_SAMPLE_RING];
    sim_bucket_t old = __atomic_load_n(b, __ATOMIC_RELAXED), nw;
    do {
        uint32_t busy = ((uint32_t)(old >> 32) == (uint32_t)k) ? (uint32_t)old : 0;
        nw = ((uint64_t)(uint32_t)k << 32) | (uint64_t)(busy + busy_us);
    } while (!__atomic_compare_exchange_n(b, &old, nw, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}

HIDDEN uint32_t sim_sample_busy_us(const struct sim_proc *p, int dev, uint64_t period_index)
{
    sim_bucket_t b = __atomic_load_n(&p->samples[dev][period_index % SIM_SAMPLE_RING], __ATOMIC_RELAXED);
    return (uint32_t)(b >> 32) == (uint32_t)period_index ? (uint32_t)b : 0;
}

HIDDEN uint64_t sim_slot_busy_us(const struct sim_proc *p, int dev, uint64_t from_ns, uint64_t to_ns)
{
    if (to_ns <= from_ns)
        return 0;
    uint64_t first = from_ns / SIM_BUCKET_NS, last = to_ns / SIM_BUCKET_NS;
    if (last - first >= SIM_BUCKETS)
        first = last - SIM_BUCKETS + 1;
    double total = 0;
    for (uint64_t e = first; e <= last; e++) {
        sim_bucket_t b = __atomic_load_n(&p->buckets[dev][e % SIM_BUCKETS], __ATOMIC_RELAXED);
        if ((uint32_t)(b >> 32) != (uint32_t)e)
            continue;
        double busy = (double)(uint32_t)b;
        uint64_t b_start = e * SIM_BUCKET_NS, b_end = b_start + SIM_BUCKET_NS;
        uint64_t lo = from_ns > b_start ? from_ns : b_start;
        uint64_t hi = to_ns < b_end ? to_ns : b_end;
        if (e == last) {
            total += busy; /* current bucket: credited up to now, all of it is inside */
        } else if (hi > lo) {
            total += busy * (double)(hi - lo) / (double)SIM_BUCKET_NS;
        }
    }
    return (uint64_t)(total + 0.5);
}

/* Parse /proc/locks once: every POSIX lock on our file in the liveness range marks
 * its slot alive, with the owner's pid as seen from this PID namespace (0 when not
 * visible). One read instead of one F_GETLK per slot. Returns -1 if unavailable. */
static int liveness_from_proc_locks(struct sim_handle *h, struct sim_live *out)
{
    struct stat st;
    if (fstat(h->fd, &st) < 0)
        return -1;
    int fd = open("/proc/locks", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    if (!buf) {
        close(fd);
        return -1;
    }
    for (;;) {
        if (len + 4096 > cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                close(fd);
                return -1;
            }
            buf = nb;
            cap *= 2;
        }
        ssize_t n = read(fd, buf + len, cap - len - 1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    buf[len] = 0;
    unsigned dev_major = major(st.st_dev), dev_minor = minor(st.st_dev);
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        /* "12: POSIX  ADVISORY  WRITE 4242 00:1a:77 1099511627776 1099511627776"
         * blocked waiters read "12: -> POSIX ..." and are skipped */
        char type[16], mode[16], rw[16];
        int pid;
        unsigned maj, mnr;
        unsigned long ino;
        unsigned long long start;
        char *colon = strchr(line, ':');
        if (!colon || strstr(line, "->"))
            continue;
        if (sscanf(colon + 1, " %15s %15s %15s %d %x:%x:%lu %llu", type, mode, rw, &pid, &maj, &mnr, &ino,
                   &start) != 8)
            continue;
        if (strcmp(type, "POSIX") != 0 || ino != (unsigned long)st.st_ino || maj != dev_major ||
            mnr != dev_minor)
            continue;
        if (start < SIM_LIVE_LOCK_BASE || start >= SIM_LIVE_LOCK_BASE + SIM_MAX_PROCS)
            continue;
        uint32_t slot = (uint32_t)(start - SIM_LIVE_LOCK_BASE);
        if (slot < out->count && h->hdr->procs[slot].in_use)
            out->pid[slot] = pid > 0 ? pid : 0;
    }
    free(buf);
    return 0;
}

HIDDEN void sim_liveness(struct sim_handle *h, const struct sim_self *self, struct sim_live *out)
{
    uint32_t hw = h->hdr->proc_high_water;
    out->count = hw > SIM_MAX_PROCS ? SIM_MAX_PROCS : hw;
    for (uint32_t i = 0; i < out->count; i++)
        out->pid[i] = -1;
    if (liveness_from_proc_locks(h, out) < 0) {
        for (uint32_t i = 0; i < out->count; i++)
            out->pid[i] = sim_slot_owner(h, (int)i, self);
        return;
    }
    /* /proc/locks is read a page at a time, so lines can be missed when other locks
     * come and go between reads: a lock seen is real, a lock not seen is confirmed
     * with F_GETLK (authoritative; it also recognises the caller's own slot). */
    for (uint32_t i = 0; i < out->count; i++)
        if (h->hdr->procs[i].in_use && out->pid[i] < 0)
            out->pid[i] = sim_slot_owner(h, (int)i, self);
        else if (h->hdr->procs[i].in_use && is_self(&h->hdr->procs[i], self))
            out->pid[i] = (int32_t)getpid();
}

HIDDEN uint64_t sim_used_bytes_live(struct sim_handle *h, int dev, const struct sim_live *live, int reap)
{
    uint64_t used = 0;
    for (uint32_t i = 0; i < live->count; i++) {
        struct sim_proc *p = &h->hdr->procs[i];
        if (!p->in_use)
            continue;
        if (live->pid[i] < 0) {
            if (reap)
                __atomic_store_n(&p->in_use, 0, __ATOMIC_RELEASE);
            continue;
        }
        used += p->memory_bytes[dev];
    }
    return used;
}

HIDDEN uint64_t sim_used_bytes_in_use(struct sim_handle *h, int dev)
{
    uint32_t hw = h->hdr->proc_high_water;
    uint32_t count = hw > SIM_MAX_PROCS ? SIM_MAX_PROCS : hw;
    uint64_t used = 0;
    for (uint32_t i = 0; i < count; i++)
        if (__atomic_load_n(&h->hdr->procs[i].in_use, __ATOMIC_ACQUIRE))
            used += h->hdr->procs[i].memory_bytes[dev];
    return used;
}

HIDDEN uint64_t sim_device_used_bytes(struct sim_handle *h, int dev, const struct sim_self *self, int reap)
{
    struct sim_live *live = malloc(sizeof(*live));
    if (!live)
        return 0;
    sim_liveness(h, self, live);
    uint64_t used = sim_used_bytes_live(h, dev, live, reap);
    free(live);
    return used;
}
