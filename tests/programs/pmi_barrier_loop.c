/* A PMI-1 client on the wire (no MPI) that asks for barriers as fast as its server answers them, whatever the
 * answer: a barrier that fails at once (the job's collective failed) is asked for again at once.
 *
 *   pmi_barrier_loop FLAG
 *
 * It sends init, waits until the file FLAG exists, then puts a value and enters a barrier, reading each
 * answer, in a loop that ends when the connection closes (exit 0) or after ten minutes (exit 1).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int fd;

/* Writes all of line; 0 once the connection is gone. */
static int say(const char *line) {
    size_t len = strlen(line);
    while (len > 0) {
        ssize_t n = write(fd, line, len);
        if (n <= 0)
            return 0;
        line += n;
        len -= (size_t)n;
    }
    return 1;
}

static char line[1100];

/* Reads one answer line into `line`; 0 once the connection is gone. */
static int hear(void) {
    size_t at = 0;
    for (;;) {
        ssize_t n = read(fd, line + at, 1);
        if (n <= 0)
            return 0;
        if (line[at] == '\n') {
            line[at] = 0;
            return 1;
        }
        at = at + 1 < sizeof line - 1 ? at + 1 : 0;
    }
}

int main(int argc, char **argv) {
    const char *env = getenv("PMI_FD");
    if (argc != 2 || !env) {
        fprintf(stderr, "usage: pmi_barrier_loop FLAG (under a PMI-1 server)\n");
        return 2;
    }
    fd = atoi(env);
    if (!say("cmd=init pmi_version=1 pmi_subversion=1\n") || !hear() || !say("cmd=get_my_kvsname\n") || !hear())
        return 0;
    char kvsname[100] = "";
    const char *at = strstr(line, "kvsname=");
    if (at)
        sscanf(at + 8, "%99s", kvsname);
    while (access(argv[1], F_OK) != 0)
        usleep(20000);
    char put[300];
    snprintf(put, sizeof put, "cmd=put kvsname=%s key=k%s value=0123456789abcdef\n", kvsname,
             getenv("PMI_RANK") ? getenv("PMI_RANK") : "0");
    time_t end = time(NULL) + 600;
    while (time(NULL) < end) {
        if (!say(put) || !hear() || !say("cmd=barrier_in\n") || !hear())
            return 0;
    }
    return 1;
}
