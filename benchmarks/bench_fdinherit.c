/* Call loops for benchmarks/bench_fdinherit.py: what the dup/fcntl/fork programs cost.
 *   bench_fdinherit PREFIX DEVFDS MODE N
 * opens DEVFDS device nodes (PREFIXctl) first, then runs N iterations of MODE and prints the
 * mean ns per iteration: fork (fork + _exit + waitpid), fcntl (F_GETFL on /dev/zero), dup
 * (dup + close of /dev/zero), dupdev (dup + close of a device fd), hold (sleep until killed). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 5)
        return 2;
    char path[512];
    snprintf(path, sizeof(path), "%sctl", argv[1]);
    int ndev = atoi(argv[2]), dev = -1;
    for (int k = 0; k < ndev; k++)
        if ((dev = open(path, O_RDWR | O_CLOEXEC)) < 0) { perror(path); return 2; }
    const char *mode = argv[3];
    long n = atol(argv[4]);
    int other = open("/dev/zero", O_RDONLY | O_CLOEXEC);
    if (!strcmp(mode, "hold")) {
        printf("ready\n");
        fflush(stdout);
        pause();
        return 0;
    }
    double t0 = now_ns();
    for (long i = 0; i < n; i++) {
        if (!strcmp(mode, "fork")) {
            pid_t c = fork();
            if (c == 0)
                _exit(0);
            waitpid(c, 0, 0);
        } else if (!strcmp(mode, "fcntl")) {
            (void)fcntl(other, F_GETFL);
        } else if (!strcmp(mode, "dup")) {
            close(dup(other));
        } else if (!strcmp(mode, "dupdev")) {
            close(dup(dev));
        }
    }
    printf("%.1f\n", (now_ns() - t0) / n);
    return 0;
}
