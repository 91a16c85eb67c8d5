/* Preloaded into every MPI process by `cargo bench --bench init -- --flux`: counts the lines the process
 * writes on its PMI connection (the fd PMI_FD names) and the time it spends in read and write on it (waits for
 * the server's answers included); of that time, how long it was ready to run but waited for a CPU (the
 * kernel's run delay, /proc/thread-self/schedstat); and when it entered each PMI-1 barrier (the write of
 * `barrier_in`) and left it (the read that completes `barrier_out`), on the machine's monotonic clock, which
 * every process of a one-machine instance shares. The program calls `pmi_time_mark` as `MPI_Init` returns:
 * what came after (the end's) is not counted. It says it all on stderr as it exits:
 * "pmi-time: lines=N seconds=S cpu_wait=S barriers=IN:OUT,IN:OUT,..." (the barriers' times in nanoseconds). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* MPICH's start-up takes two; more are not noted. */
#define BARRIERS_MAX 16

static int pmi_fd = -2, schedstat = -2;
static long lines, nanoseconds, waited_for_cpu;
static long entered[BARRIERS_MAX], left[BARRIERS_MAX];
static int barriers;
/* MPI_Init has returned: nothing more is counted. */
static int marked;
/* In a barrier: how much of "barrier_out" the answer read so far ends with. */
static int in_barrier;
static size_t matched;
static const char ANSWER[] = "barrier_out";

static int the_pmi_fd(void) {
    if (pmi_fd == -2) {
        const char *s = getenv("PMI_FD");
        pmi_fd = s ? atoi(s) : -1;
    }
    return pmi_fd;
}

static long now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* The calling thread's time ready to run but not running so far, in nanoseconds (0 where unknown). */
static long run_delay(void) {
    if (schedstat == -2)
        schedstat = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    char text[96];
    ssize_t n = schedstat < 0 ? -1 : pread(schedstat, text, sizeof text - 1, 0);
    if (n <= 0)
        return 0;
    text[n] = 0;
    long on_cpu, delay;
    return sscanf(text, "%ld %ld", &on_cpu, &delay) == 2 ? delay : 0;
}

/* Counts a call on the PMI connection that began at `start` with the run delay `delay`. */
static void count(long start, long delay, long end) {
    nanoseconds += end - start;
    waited_for_cpu += run_delay() - delay;
}

void pmi_time_mark(void) { marked = 1; }

ssize_t write(int fd, const void *buf, size_t n) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real)
        real = (ssize_t(*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    if (fd < 0 || marked || fd != the_pmi_fd())
        return real(fd, buf, n);
    long delay = run_delay(), start = now();
    ssize_t r = real(fd, buf, n);
    count(start, delay, now());
    for (ssize_t i = 0; i < r; i++)
        lines += ((const char *)buf)[i] == '\n';
    if (r > 0 && !in_barrier && memmem(buf, (size_t)r, "cmd=barrier_in", 14)) {
        in_barrier = 1;
        matched = 0;
        if (barriers < BARRIERS_MAX)
            entered[barriers] = start;
    }
    return r;
}

ssize_t read(int fd, void *buf, size_t n) {
    static ssize_t (*real)(int, void *, size_t);
    if (!real)
        real = (ssize_t(*)(int, void *, size_t))dlsym(RTLD_NEXT, "read");
    if (fd < 0 || marked || fd != the_pmi_fd())
        return real(fd, buf, n);
    long delay = run_delay(), start = now();
    ssize_t r = real(fd, buf, n);
    long end = now();
    count(start, delay, end);
    /* The answer may come split over reads: "barrier_out" repeats no prefix of itself but its first letter. */
    for (ssize_t i = 0; in_barrier && i < r; i++) {
        char c = ((const char *)buf)[i];
        matched = c == ANSWER[matched] ? matched + 1 : c == ANSWER[0];
        if (matched == sizeof ANSWER - 1) {
            if (barriers < BARRIERS_MAX)
                left[barriers] = end;
            barriers++;
            in_barrier = 0;
        }
    }
    return r;
}

__attribute__((destructor)) static void report(void) {
    if (pmi_fd < 0)
        return;
    fprintf(stderr, "pmi-time: lines=%ld seconds=%.6f cpu_wait=%.6f barriers=", lines, nanoseconds / 1e9,
            waited_for_cpu / 1e9);
    for (int i = 0; i < barriers && i < BARRIERS_MAX; i++)
        fprintf(stderr, "%s%ld:%ld", i ? "," : "", entered[i], left[i]);
    fprintf(stderr, "\n");
}
