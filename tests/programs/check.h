/* What the API test programs (pmi_api.c, pmi2_api.c) check with: a call's return code, or a condition, each
 * naming the rank and the line when it fails, and ending the program; and that init leaves the launcher's
 * connection close-on-exec. */
#ifndef RPMI_TEST_CHECK_H
#define RPMI_TEST_CHECK_H

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>

/* The rank, once the program knows it (-1 before). */
static int rank = -1;

#define CHECK(call, want)                                                                                   \
    do {                                                                                                    \
        int rc_ = (call);                                                                                   \
        if (rc_ != (want)) {                                                                                \
            fprintf(stderr, "rank %d: %s returned %d, not %d (line %d)\n", rank, #call, rc_, (want), __LINE__); \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

#define EXPECT(cond)                                                                                        \
    do {                                                                                                    \
        if (!(cond)) {                                                                                      \
            fprintf(stderr, "rank %d: %s does not hold (line %d)\n", rank, #cond, __LINE__);                \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

/* The descriptors the close-on-exec check looks at. */
#define FDS 1024

/* Which of the descriptors are open: before init, to tell those it opens (a PMI_PORT connection). */
__attribute__((unused)) static void open_fds(char open[FDS])
{
    for (int fd = 0; fd < FDS; fd++)
        open[fd] = fcntl(fd, F_GETFD) >= 0;
}

/* After init: the launcher's connection, given (PMI_FD) or opened by init (not open `before`), is
 * close-on-exec, so that a program the task execs neither speaks on it nor keeps it open once the task ends.
 * Told by its flag, and by a shell the task starts, which must not find it. */
__attribute__((unused)) static void expect_connection_close_on_exec(const char before[FDS])
{
    const char *given = getenv("PMI_FD");
    char command[64];
    for (int fd = 3; fd < FDS; fd++) {
        int flags = fcntl(fd, F_GETFD);
        if (flags < 0 || (before[fd] && !(given && atoi(given) == fd)))
            continue;
        snprintf(command, sizeof command, "test ! -e /proc/self/fd/%d", fd);
        if (!(flags & FD_CLOEXEC) || system(command) != 0) {
            fprintf(stderr, "rank %d: descriptor %d, the launcher's connection, stays open across exec\n", rank, fd);
            exit(1);
        }
    }
}

#endif
