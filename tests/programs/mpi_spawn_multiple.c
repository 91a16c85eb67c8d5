/* Dynamic processes: MPI_Comm_spawn_multiple of two commands, both this program with different arguments.
 *
 *   mpi_spawn_multiple
 *
 * The started job spawns 1 copy with argv "a" (command 0) and 2 copies with argv "b" "two words" (command
 * 1; the space checks that an argument travels whole). Each child checks that its MPI_APPNUM is its
 * command's number and its argv is that command's; then parents and children merge and check an Allreduce
 * of (1, merged rank, appnum). Failed checks abort with codes 10 and up; a process still running after
 * 100 s exits 3. */
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A spawn whose children never connect waits forever: after 100 s, say so and exit 3. */
static void stuck(int sig) {
    (void)sig;
    static const char msg[] =
        "mpi_spawn_multiple: no result after 100 s (stuck in MPI_Init, a spawn, a merge or a disconnect)\n";
    ssize_t n = write(2, msg, sizeof msg - 1);
    (void)n;
    _exit(3);
}

static void fail(int code, const char *who, int rank, const char *what) {
    fprintf(stderr, "mpi_spawn_multiple: %s rank %d: %s\n", who, rank, what);
    MPI_Abort(MPI_COMM_WORLD, code);
}

/* Sums (1, merged rank, appnum) over the merged communicator and checks them: n processes, and the
 * children's appnums 0 + 1 + 1 (the parents are all appnum 0). */
static void check_merged(MPI_Comm merged, int appnum, int n, const char *who, int rank) {
    int mrank;
    MPI_Comm_rank(merged, &mrank);
    long mine[3] = {1, mrank, appnum}, sums[3];
    MPI_Allreduce(mine, sums, 3, MPI_LONG, MPI_SUM, merged);
    if (sums[0] != n || sums[1] != (long)n * (n - 1) / 2 || sums[2] != 2) {
        char msg[160];
        snprintf(msg, sizeof msg, "sums (%ld %ld %ld), expected (%d %ld 2)", sums[0], sums[1], sums[2], n,
                 (long)n * (n - 1) / 2);
        fail(11, who, rank, msg);
    }
}

int main(int argc, char **argv) {
    signal(SIGALRM, stuck);
    alarm(100);
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int *appnum, flag;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag);
    if (!flag) fail(10, "any", rank, "MPI_APPNUM is not set");
    char msg[200];
    MPI_Comm parent, merged;
    MPI_Comm_get_parent(&parent);

    if (parent == MPI_COMM_NULL) {
        if (argc != 1) fail(2, "parent", rank, "usage: mpi_spawn_multiple (no arguments)");
        char self[4096];
        char *command = argv[0];
        /* The launcher resolves the command from its own working directory (or PATH). */
        if (strchr(argv[0], '/')) {
            if (!realpath(argv[0], self)) fail(12, "parent", rank, "realpath(argv[0]) failed");
            command = self;
        }
        char *commands[2] = {command, command};
        char *argv_a[] = {"a", NULL}, *argv_b[] = {"b", "two words", NULL};
        char **argvs[2] = {argv_a, argv_b};
        int maxprocs[2] = {1, 2};
        MPI_Info infos[2] = {MPI_INFO_NULL, MPI_INFO_NULL};
        int errcodes[3];
        MPI_Comm inter;
        MPI_Comm_spawn_multiple(2, commands, argvs, maxprocs, infos, 0, MPI_COMM_WORLD, &inter, errcodes);
        for (int i = 0; i < 3; i++) {
            if (errcodes[i] != MPI_SUCCESS) {
                snprintf(msg, sizeof msg, "errcodes[%d] is %d", i, errcodes[i]);
                fail(13, "parent", rank, msg);
            }
        }
        MPI_Intercomm_merge(inter, 0, &merged);
        check_merged(merged, *appnum, size + 3, "parent", rank);
        MPI_Comm_free(&merged);
        MPI_Comm_disconnect(&inter);
        if (rank == 0) {
            printf("mpi_spawn_multiple: %d parents, 1 child of command 0 and 2 of command 1: appnums, argvs and "
                   "merge checked\n", size);
        }
    } else {
        /* Children are numbered in command order: rank 0 is command 0's only copy. */
        int expect = rank == 0 ? 0 : 1;
        if (size != 3 || *appnum != expect) {
            snprintf(msg, sizeof msg, "world size %d, appnum %d, expected size 3 and appnum %d", size, *appnum, expect);
            fail(14, "child", rank, msg);
        }
        int args_ok = expect == 0 ? argc == 2 && strcmp(argv[1], "a") == 0
                                  : argc == 3 && strcmp(argv[1], "b") == 0 && strcmp(argv[2], "two words") == 0;
        if (!args_ok) {
            snprintf(msg, sizeof msg, "appnum %d got argc %d, argv[1] \"%s\", argv[2] \"%s\"", *appnum, argc,
                     argc > 1 ? argv[1] : "", argc > 2 ? argv[2] : "");
            fail(15, "child", rank, msg);
        }
        int parents;
        MPI_Comm_remote_size(parent, &parents);
        MPI_Intercomm_merge(parent, 1, &merged);
        check_merged(merged, *appnum, parents + 3, "child", rank);
        MPI_Comm_free(&merged);
        MPI_Comm_disconnect(&parent);
    }
    MPI_Finalize();
    return 0;
}
