/* Dynamic processes: spawning a program that does not exist must fail, and return, not hang.
 *
 *   mpi_spawn_missing [COMMAND]
 *
 * With MPI_ERRORS_RETURN, the job collectively spawns 2 copies of COMMAND (default
 * "./no-such-program-rpmi"). It expects an error from MPI_Comm_spawn or an errcode that is not
 * MPI_SUCCESS, prints what it got, and exits 0; a spawn that succeeds exits 1. A spawn that has not
 * returned after 60 s exits 3 (MPICH waits for the children to connect unless the process manager reports
 * every one of them failed, so a failure it was not told of hangs there). */
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void stuck(int sig) {
    (void)sig;
    static const char msg[] = "mpi_spawn_missing: MPI_Comm_spawn has not returned after 60 s\n";
    ssize_t n = write(2, msg, sizeof msg - 1);
    (void)n;
    _exit(3);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
    char *command = argc > 1 ? argv[1] : "./no-such-program-rpmi";
    int errcodes[2] = {-1, -1};
    MPI_Comm inter = MPI_COMM_NULL;
    signal(SIGALRM, stuck);
    alarm(60);
    int err = MPI_Comm_spawn(command, MPI_ARGV_NULL, 2, MPI_INFO_NULL, 0, MPI_COMM_WORLD, &inter, errcodes);
    alarm(0);
    if (err == MPI_SUCCESS && errcodes[0] == MPI_SUCCESS && errcodes[1] == MPI_SUCCESS) {
        fprintf(stderr, "mpi_spawn_missing: rank %d: spawning %s succeeded\n", rank, command);
        return 1;
    }
    /* The intercomm is left alone: MPICH returns a communicator that cannot be used or freed when every
     * process failed to start. */
    if (rank == 0) {
        int class = -1, len;
        char text[MPI_MAX_ERROR_STRING] = "";
        if (err != MPI_SUCCESS) {
            MPI_Error_class(err, &class);
            MPI_Error_string(err, text, &len);
        }
        /* MPICH's message is a stack of lines; the last says what failed first. */
        char *last = text;
        for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) last = line;
        printf("mpi_spawn_missing: MPI_Comm_spawn returned %d (class %d: %s), errcodes %d %d\n", err, class, last,
               errcodes[0], errcodes[1]);
        printf("mpi_spawn_missing: spawn failed as expected\n");
    }
    MPI_Finalize();
    return 0;
}
