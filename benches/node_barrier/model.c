/* What a barrier of N processes costs on this machine by the three ways rpmi could run one on a node, with
 * no PMI in it: the same sends and sleeps, so that the difference is the kernel's and the scheduler's.
 *
 *   lines   every process sends a line to a server process and waits in poll for its answer; the server
 *           reads them (epoll) and, once all are in, answers each (rpmi's barrier by lines);
 *   release every process sends its line as before but waits on a futex, which the server moves and wakes
 *           once all are in (the release alone on shared memory);
 *   page    every process adds itself to a count on shared memory and waits on a futex; the last one in
 *           moves it and wakes all (the arrivals and the release on shared memory: rpmi's node barrier,
 *           whose last task sends the server one line, which this leaves out).
 *
 * Build and run (prints one table; times are the mean of ROUNDS barriers, in µs, after 10 to warm up):
 *   cc -O2 -o /tmp/model benches/node_barrier/model.c && /tmp/model 4,32,64,96 2000
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum way { LINES, RELEASE, PAGE };
enum { WARM = 10, MAX = 1024 };

struct shared {
    _Atomic unsigned count, generation;
    double us; /* rank 0's result */
};

static void futex(_Atomic unsigned *word, int op, unsigned value)
{
    syscall(SYS_futex, word, op, value, NULL, NULL, 0);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The mean µs of `rounds` barriers of n processes, the given way. */
static double barrier(enum way way, int n, int rounds)
{
    struct shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    static int fds[MAX][2];
    for (int i = 0; i < n && way != PAGE; i++)
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds[i]) != 0)
            exit(1);
    for (int i = 0; i < n; i++) {
        if (fork() != 0)
            continue;
        double start = 0;
        char answer[64];
        for (int r = 0; r < rounds + WARM; r++) {
            if (r == WARM)
                start = now();
            unsigned generation = atomic_load(&sh->generation);
            if (way == PAGE) {
                if (atomic_fetch_add(&sh->count, 1) + 1 == (unsigned)n) {
                    atomic_store(&sh->count, 0);
                    atomic_fetch_add(&sh->generation, 1);
                    futex(&sh->generation, FUTEX_WAKE, INT_MAX);
                }
            } else if (send(fds[i][1], "cmd=barrier_in\n", 15, MSG_NOSIGNAL) != 15) {
                _exit(1);
            }
            if (way == LINES) {
                struct pollfd p = {fds[i][1], POLLIN, 0};
                poll(&p, 1, -1);
                if (read(fds[i][1], answer, sizeof answer) <= 0)
                    _exit(1);
            } else {
                while (atomic_load(&sh->generation) == generation)
                    futex(&sh->generation, FUTEX_WAIT, generation);
            }
        }
        if (i == 0)
            sh->us = (now() - start) / rounds * 1e6;
        _exit(0);
    }
    if (way != PAGE) {
        int ep = epoll_create1(0);
        for (int i = 0; i < n; i++) {
            struct epoll_event e = {.events = EPOLLIN, .data.u32 = (unsigned)i};
            epoll_ctl(ep, EPOLL_CTL_ADD, fds[i][0], &e);
        }
        int in = 0, left = (rounds + WARM) * n;
        char buf[256];
        struct epoll_event ready[256];
        while (left > 0) {
            int m = epoll_wait(ep, ready, 256, -1);
            for (int j = 0; j < m; j++) {
                ssize_t got = read(fds[ready[j].data.u32][0], buf, sizeof buf);
                if (got <= 0)
                    continue;
                in += (int)got / 15;
                left -= (int)got / 15;
                if (in < n)
                    continue;
                in = 0;
                if (way == LINES) {
                    for (int k = 0; k < n; k++)
                        send(fds[k][0], "cmd=barrier_out rc=0\n", 21, MSG_NOSIGNAL);
                } else {
                    atomic_fetch_add(&sh->generation, 1);
                    futex(&sh->generation, FUTEX_WAKE, INT_MAX);
                }
            }
        }
        close(ep);
    }
    while (wait(NULL) > 0) {
    }
    for (int i = 0; i < n && way != PAGE; i++)
        close(fds[i][0]), close(fds[i][1]);
    double us = sh->us;
    munmap(sh, sizeof *sh);
    return us;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s N[,N...] ROUNDS\n", argv[0]);
        return 2;
    }
    int rounds = atoi(argv[2]);
    printf("| processes | lines (µs) | release on a futex (µs) | page (µs) |\n|---|---|---|---|\n");
    for (char *n = strtok(argv[1], ","); n; n = strtok(NULL, ",")) {
        int size = atoi(n);
        if (size < 1 || size > MAX)
            return 2;
        printf("| %d", size);
        for (int way = LINES; way <= PAGE; way++)
            printf(" | %.1f", barrier((enum way)way, size, rounds));
        printf(" |\n");
        fflush(stdout);
    }
    return 0;
}
