/* Dynamic processes: MPI_Comm_spawn of copies of this program, one or two levels deep.
 *
 *   mpi_spawn CHILDREN [DEPTH]
 *
 * The started job (level 0) collectively spawns CHILDREN copies of itself at level 1; with DEPTH 2 those
 * children in turn spawn CHILDREN of their own at level 2. Each parent/children pair merges its intercomm
 * and checks an Allreduce of (1, merged rank, level, processes below) over it, so level 0's rank 0 learns
 * how many processes the whole tree had. A child's argv is "CHILDREN DEPTH LEVEL". With
 * MPI_SPAWN_ABORT_LEVEL=L in the environment, rank 0 of level L calls MPI_Abort with 42 once it is up; with
 * MPI_SPAWN_COMMANDS=N, level 0 was started as N commands (its appnums 0 to N-1).
 * Failed checks abort with codes 10 and up (the code says which check); a process still running after 100 s
 * exits 3. */
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
        "mpi_spawn: no result after 100 s (stuck in MPI_Init, a spawn, a merge or a disconnect)\n";
    ssize_t n = write(2, msg, sizeof msg - 1);
    (void)n;
    _exit(3);
}

static void fail(int code, const char *what, int level, int rank) {
    fprintf(stderr, "mpi_spawn: level %d rank %d: %s\n", level, rank, what);
    MPI_Abort(MPI_COMM_WORLD, code);
}

/* The Allreduce over the merged parent/children communicator. Returns the sums: processes, merged ranks,
 * levels, processes below. */
static void merged_sums(MPI_Comm merged, int level, long below, long sums[4]) {
    int mrank;
    MPI_Comm_rank(merged, &mrank);
    long mine[4] = {1, mrank, level, below};
    MPI_Allreduce(mine, sums, 4, MPI_LONG, MPI_SUM, merged);
}

int main(int argc, char **argv) {
    signal(SIGALRM, stuck);
    alarm(100);
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int children = argc > 1 ? atoi(argv[1]) : 0;
    int depth = argc > 2 ? atoi(argv[2]) : 1;
    int level = argc > 3 ? atoi(argv[3]) : 0;
    if (children < 1 || depth < 1 || depth > 2 || level < 0 || level > depth) {
        if (rank == 0) fprintf(stderr, "usage: mpi_spawn CHILDREN [DEPTH 1 or 2]\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    /* For the test that an abort in a spawned job ends the whole launch: rank 0 of the level named by
     * MPI_SPAWN_ABORT_LEVEL aborts with 42 as soon as it is up. */
    const char *abort_level = getenv("MPI_SPAWN_ABORT_LEVEL");
    if (abort_level && atoi(abort_level) == level && rank == 0) MPI_Abort(MPI_COMM_WORLD, 42);
    char msg[200];

    /* Only spawned levels have a parent. */
    MPI_Comm parent;
    MPI_Comm_get_parent(&parent);
    if ((parent == MPI_COMM_NULL) != (level == 0)) {
        fail(10, "MPI_Comm_get_parent disagrees with the level", level, rank);
    }
    /* A spawned world is exactly CHILDREN processes. */
    if (level > 0 && size != children) {
        snprintf(msg, sizeof msg, "world size %d, expected %d", size, children);
        fail(11, msg, level, rank);
    }
    /* The attributes must be readable; a single command (mpiexec's or MPI_Comm_spawn's) is appnum 0, and the
     * started job's commands (MPI_SPAWN_COMMANDS of them, default 1: srun A : B is 2) are 0 and up. */
    int *universe, *appnum, uflag, aflag;
    if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_UNIVERSE_SIZE, &universe, &uflag) != MPI_SUCCESS ||
        MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &aflag) != MPI_SUCCESS)
        fail(12, "MPI_Comm_get_attr failed", level, rank);
    const char *commands_text = getenv("MPI_SPAWN_COMMANDS");
    int commands = level == 0 && commands_text ? atoi(commands_text) : 1;
    if (!aflag || *appnum < 0 || *appnum >= commands) {
        snprintf(msg, sizeof msg, "MPI_APPNUM %s %d, expected 0 to %d", aflag ? "is" : "unset,", aflag ? *appnum : -1,
                 commands - 1);
        fail(13, msg, level, rank);
    }
    if (uflag && *universe < 1) {
        snprintf(msg, sizeof msg, "MPI_UNIVERSE_SIZE is %d", *universe);
        fail(14, msg, level, rank);
    }

    /* Spawn the next level first, so a level-1 child can tell its parents how many processes it started. */
    long below = 0;
    if (level < depth) {
        /* The launcher resolves the command from its own working directory (or PATH), so pass an absolute
         * path when argv[0] has a directory in it. */
        char self[4096];
        const char *command = argv[0];
        if (strchr(argv[0], '/')) {
            if (!realpath(argv[0], self)) fail(15, "realpath(argv[0]) failed", level, rank);
            command = self;
        }
        char next[3][16];
        snprintf(next[0], sizeof next[0], "%d", children);
        snprintf(next[1], sizeof next[1], "%d", depth);
        snprintf(next[2], sizeof next[2], "%d", level + 1);
        char *child_argv[] = {next[0], next[1], next[2], NULL};
        int errcodes[children];
        MPI_Comm inter, merged;
        MPI_Comm_spawn(command, child_argv, children, MPI_INFO_NULL, 0, MPI_COMM_WORLD, &inter, errcodes);
        for (int i = 0; i < children; i++) {
            if (errcodes[i] != MPI_SUCCESS) {
                snprintf(msg, sizeof msg, "errcodes[%d] is %d", i, errcodes[i]);
                fail(16, msg, level, rank);
            }
        }
        int remote;
        MPI_Comm_remote_size(inter, &remote);
        if (remote != children) {
            snprintf(msg, sizeof msg, "intercomm has %d children, expected %d", remote, children);
            fail(17, msg, level, rank);
        }
        /* Parents first (high = 0), so a parent's merged rank is its world rank. */
        MPI_Intercomm_merge(inter, 0, &merged);
        long sums[4];
        merged_sums(merged, level, 0, sums);
        long n = size + children;
        long expect[4] = {n, n * (n - 1) / 2, (long)size * level + (long)children * (level + 1), sums[3]};
        if (memcmp(sums, expect, sizeof sums) != 0) {
            snprintf(msg, sizeof msg, "as a parent, sums (%ld %ld %ld %ld), expected (%ld %ld %ld any)", sums[0],
                     sums[1], sums[2], sums[3], expect[0], expect[1], expect[2]);
            fail(18, msg, level, rank);
        }
        below = children + sums[3];
        MPI_Comm_free(&merged);
        MPI_Comm_disconnect(&inter);
    }

    if (parent != MPI_COMM_NULL) {
        int parents, mrank;
        MPI_Comm_remote_size(parent, &parents);
        MPI_Comm merged;
        MPI_Intercomm_merge(parent, 1, &merged);
        MPI_Comm_rank(merged, &mrank);
        if (mrank != parents + rank) {
            snprintf(msg, sizeof msg, "merged rank %d, expected %d", mrank, parents + rank);
            fail(19, msg, level, rank);
        }
        /* Only one rank reports what this world spawned, so the parents count it once. */
        long sums[4];
        merged_sums(merged, level, rank == 0 ? below : 0, sums);
        long n = parents + size, levels = (long)parents * (level - 1) + (long)size * level;
        if (sums[0] != n || sums[1] != n * (n - 1) / 2 || sums[2] != levels) {
            snprintf(msg, sizeof msg, "as a child, sums (%ld %ld %ld), expected (%ld %ld %ld)", sums[0], sums[1],
                     sums[2], n, n * (n - 1) / 2, levels);
            fail(20, msg, level, rank);
        }
        MPI_Comm_free(&merged);
        MPI_Comm_disconnect(&parent);
    }

    MPI_Barrier(MPI_COMM_WORLD);
    if (level == 0 && rank == 0) {
        printf("mpi_spawn: %d parents, %d children, depth %d (%ld processes below the parents): merged and checked\n",
               size, children, depth, below);
    }
    MPI_Finalize();
    return 0;
}
