/* Preloaded into every MPI process by `cargo bench --bench init -- --flux`: counts the lines the process
 * writes on its PMI connection (the fd PMI_FD names) and the time it spends in read and write on it (waits for
 * the server's answers included), and says both on stderr as it exits: "pmi-time: lines=N seconds=S". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static int pmi_fd = -2;
static long lines, nanoseconds;

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

ssize_t write(int fd, const void *buf, size_t n) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real)
        real = (ssize_t(*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    if (fd < 0 || fd != the_pmi_fd())
        return real(fd, buf, n);
    long start = now();
    ssize_t r = real(fd, buf, n);
    long newlines = 0;
    for (ssize_t i = 0; i < r; i++)
        newlines += ((const char *)buf)[i] == '\n';
    __atomic_add_fetch(&nanoseconds, now() - start, __ATOMIC_RELAXED);
    __atomic_add_fetch(&lines, newlines, __ATOMIC_RELAXED);
    return r;
}

ssize_t read(int fd, void *buf, size_t n) {
    static ssize_t (*real)(int, void *, size_t);
    if (!real)
        real = (ssize_t(*)(int, void *, size_t))dlsym(RTLD_NEXT, "read");
    if (fd < 0 || fd != the_pmi_fd())
        return real(fd, buf, n);
    long start = now();
    ssize_t r = real(fd, buf, n);
    __atomic_add_fetch(&nanoseconds, now() - start, __ATOMIC_RELAXED);
    return r;
}

__attribute__((destructor)) static void report(void) {
    if (pmi_fd < 0)
        return;
    fprintf(stderr, "pmi-time: lines=%ld seconds=%.6f\n", lines, nanoseconds / 1e9);
}
