/* A PMI-1 client on the wire (no MPI): every rank but one waits in a barrier, and once all of them are in it,
 * that one rank breaks the job.
 *
 *   pmi_barrier_break DIR RANK ACTION
 *
 * Each waiting rank sends init and barrier_in, then creates DIR/in.<rank> and waits for the answer (it exits
 * 0 on one, or when the connection closes). Rank RANK sends init, waits until every other rank's file
 * exists (so their barrier_in reached the server before what it does next), then does ACTION:
 *   abort:CODE  cmd=abort exitcode=CODE, then exits with CODE once answered
 *   garbage     a line that is not PMI-1 (a protocol error), then waits for the server to close
 *   exit:CODE   exits with CODE without PMI_Finalize
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fd;

static void say(const char *line) {
    size_t len = strlen(line);
    while (len > 0) {
        ssize_t n = write(fd, line, len);
        if (n <= 0) {
            perror("pmi_barrier_break: write");
            exit(90);
        }
        line += n;
        len -= (size_t)n;
    }
}

/* Reads one answer line; returns 0 at the end of the connection. */
static int hear(void) {
    char c;
    for (;;) {
        ssize_t n = read(fd, &c, 1);
        if (n <= 0)
            return 0;
        if (c == '\n')
            return 1;
    }
}

int main(int argc, char **argv) {
    const char *pmi_fd = getenv("PMI_FD"), *pmi_rank = getenv("PMI_RANK"), *pmi_size = getenv("PMI_SIZE");
    if (argc != 4 || !pmi_fd || !pmi_rank || !pmi_size) {
        fprintf(stderr, "usage: pmi_barrier_break DIR RANK ACTION, as a task of a PMI-1 server\n");
        return 91;
    }
    fd = atoi(pmi_fd);
    int rank = atoi(pmi_rank), size = atoi(pmi_size), breaker = atoi(argv[2]);
    char path[4096];
    say("cmd=init pmi_version=1 pmi_subversion=1\n");
    if (!hear())
        return 92;
    if (rank != breaker) {
        say("cmd=barrier_in\n");
        snprintf(path, sizeof path, "%s/in.%d", argv[1], rank);
        int f = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
        if (f < 0) {
            perror(path);
            return 93;
        }
        close(f);
        hear();
        return 0;
    }
    for (int r = 0; r < size; r++) {
        snprintf(path, sizeof path, "%s/in.%d", argv[1], r);
        while (r != breaker && access(path, F_OK) != 0)
            usleep(10000);
    }
    int code;
    if (sscanf(argv[3], "abort:%d", &code) == 1) {
        char line[64];
        snprintf(line, sizeof line, "cmd=abort exitcode=%d\n", code);
        say(line);
        hear();
        return code;
    }
    if (strcmp(argv[3], "garbage") == 0) {
        say("this is not PMI-1\n");
        while (hear()) {
        }
        return 0;
    }
    if (sscanf(argv[3], "exit:%d", &code) == 1)
        return code;
    fprintf(stderr, "pmi_barrier_break: unknown action '%s'\n", argv[3]);
    return 94;
}
