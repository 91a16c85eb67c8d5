/* The node barrier's page as a task receives it and uses it (rpmi=3): written on the wire by hand, so that
 * the task holds the page itself and counts itself in as rpmi's libraries do (crates/client/src/node_barrier.rs).
 *
 *   node_barrier ROUNDS [LEAVER]
 *
 * Each rank says init with rpmi=3, puts a key and enters the first barrier by a line; its answer says
 * node_barrier=M (the ranks of its node) and brings the page, with its own first byte or the put's answer's.
 * It checks that the page
 *   - is 4096 bytes, sealed against shrinking, growing and new seals, but writable and close-on-exec;
 *   - cannot be shrunk or grown (so no task can make another's or its server's accesses fault);
 *   - cannot be opened by another user through /proc of the task or of its server;
 * then runs ROUNDS barriers on it: puts a key (answered), counts itself in, the last one in sends
 * node_barrier_in, waits for the generation to move by 2 (a release) and reads its code, 0; then gets the key
 * the next rank put that round. Prints "rank R of S: ok members=M" and finalizes.
 *
 * With LEAVER, that rank exits without finalizing once past the first barrier; every other rank goes on, finds
 * the page broken (woken by the break if it already waits on it), asks by a line (barrier_in) and must hear
 * rc=-1 naming rank LEAVER; it then exits 1 ("rank R: told rank L went"). Run as root (for the setuid). */
#define _GNU_SOURCE
#include "check.h"
#include "wire.h"
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>

/* rpmi_wire::node_barrier's words. */
enum { ARRIVED, GENERATION, CODE, BROKEN, PAGE = 4096 };

static _Atomic unsigned *words;
static unsigned members;

/* A barrier on the page: 1 released (its code in *code), 0 found broken. */
static int page_barrier(int *code)
{
    unsigned generation = atomic_load(&words[GENERATION]);
    if (atomic_fetch_add(&words[ARRIVED], 1) + 1 == members) {
        atomic_store(&words[ARRIVED], 0);
        say("cmd=node_barrier_in\n");
    }
    for (;;) {
        unsigned now = atomic_load(&words[GENERATION]);
        if (now - generation >= 2) {
            *code = (int)atomic_load(&words[CODE]);
            return 1;
        }
        /* A release moves the generation before it marks the page broken: look again. */
        if (atomic_load(&words[BROKEN])) {
            if (atomic_load(&words[GENERATION]) - generation >= 2) {
                *code = (int)atomic_load(&words[CODE]);
                return 1;
            }
            return 0;
        }
        struct timespec look = {.tv_sec = 0, .tv_nsec = 100000000};
        syscall(SYS_futex, &words[GENERATION], FUTEX_WAIT, now, &look, NULL, 0);
    }
}

int main(int argc, char **argv)
{
    EXPECT(argc == 2 || argc == 3);
    int rounds = atoi(argv[1]), leaver = argc == 3 ? atoi(argv[2]) : -1;
    char buf[512], kvs[256];
    int size = start(3, kvs, sizeof kvs);

    /* The first barrier, by a line: its answer brings the page. */
    snprintf(buf, sizeof buf, "cmd=put kvsname=%s key=first-%d value=%d\ncmd=barrier_in\n", kvs, rank, rank);
    say(buf);
    int page = hear();
    EXPECT(strstr(line, "cmd=put_result rc=0"));
    int with_answer = hear();
    EXPECT(strstr(line, "cmd=barrier_out rc=0") && (page < 0) != (with_answer < 0));
    page = page < 0 ? with_answer : page;
    members = (unsigned)field("node_barrier");
    EXPECT(members >= 1 && members <= (unsigned)size);

    struct stat st;
    EXPECT(fstat(page, &st) == 0 && st.st_size == PAGE);
    EXPECT(fcntl(page, F_GET_SEALS) == (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL));
    EXPECT(fcntl(page, F_GETFD) & FD_CLOEXEC);
    EXPECT(ftruncate(page, 0) < 0 && errno == EPERM);
    EXPECT(ftruncate(page, 2 * PAGE) < 0 && errno == EPERM);
    EXPECT(pwrite(page, "x", 1, 2 * PAGE) < 0 && errno == EPERM);
    EXPECT(fcntl(page, F_ADD_SEALS, F_SEAL_WRITE) < 0 && errno == EPERM);
    others_cannot_open(getpid());
    others_cannot_open(getppid());
    words = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, page, 0);
    EXPECT(words != MAP_FAILED);
    close(page);

    if (rank == leaver)
        _exit(0);
    for (int round = 0; round < rounds || leaver >= 0; round++) {
        snprintf(buf, sizeof buf, "cmd=put kvsname=%s key=round-%d-%d value=%d\n", kvs, round, rank, round * 1000 + rank);
        say(buf);
        EXPECT(hear() < 0 && strstr(line, "cmd=put_result rc=0"));
        int code = -2;
        if (!page_barrier(&code)) {
            /* Broken: by a line, whose answer names who went. */
            EXPECT(leaver >= 0);
            say("cmd=barrier_in\n");
            EXPECT(hear() < 0 && strstr(line, "cmd=barrier_out rc=-1"));
            snprintf(buf, sizeof buf, "rank_%d_", leaver);
            EXPECT(strstr(line, buf) != NULL);
            fprintf(stderr, "rank %d: told rank %d went\n", rank, leaver);
            return 1;
        }
        EXPECT(code == 0);
        int next = (rank + 1) % size;
        snprintf(buf, sizeof buf, "cmd=get kvsname=%s key=round-%d-%d\n", kvs, round, next);
        say(buf);
        EXPECT(hear() < 0 && strstr(line, "cmd=get_result rc=0") && field("value") == round * 1000 + next);
    }
    printf("rank %d of %d: ok members=%u\n", rank, size, members);
    fflush(stdout);
    say("cmd=finalize\n");
    EXPECT(hear() < 0);
    return 0;
}
