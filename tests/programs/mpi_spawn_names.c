/* Names across a spawn: the spawner's rank 0 publishes a service, then the job spawns 2 copies of this
 * program. The children's rank 0 looks that service up (it must find the spawner's port), publishes one of
 * its own and says so over the intercomm; the spawner's rank 0 then looks the children's up, and each side
 * unpublishes its own. Prints one line from the spawner's rank 0; a failed check aborts with 10 and up. A
 * process still running after 60 s exits 3. */
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void stuck(int sig) {
    (void)sig;
    static const char msg[] = "mpi_spawn_names: no result after 60 s\n";
    ssize_t n = write(2, msg, sizeof msg - 1);
    (void)n;
    _exit(3);
}

static void check(int ok, int code, const char *what) {
    if (!ok) {
        fprintf(stderr, "mpi_spawn_names: %s\n", what);
        MPI_Abort(MPI_COMM_WORLD, code);
    }
}

/* Looks `service` up and checks that it names `want`. */
static void look_up(const char *service, const char *want, int code) {
    char port[MPI_MAX_PORT_NAME] = "";
    check(MPI_Lookup_name(service, MPI_INFO_NULL, port) == MPI_SUCCESS, code, "a lookup failed");
    check(strcmp(port, want) == 0, code + 1, "a lookup found another port");
}

int main(int argc, char **argv) {
    signal(SIGALRM, stuck);
    alarm(60);
    MPI_Init(&argc, &argv);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int rank, ok = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm parent, children;
    MPI_Comm_get_parent(&parent);
    if (parent == MPI_COMM_NULL) {
        if (rank == 0)
            check(MPI_Publish_name("rpmi-spawner-svc", MPI_INFO_NULL, "spawner-port") == MPI_SUCCESS, 10,
                  "the spawner's publish failed");
        MPI_Barrier(MPI_COMM_WORLD);
        char *child_argv[] = {"child", NULL};
        MPI_Comm_spawn(argv[0], child_argv, 2, MPI_INFO_NULL, 0, MPI_COMM_WORLD, &children, MPI_ERRCODES_IGNORE);
        if (rank == 0) {
            MPI_Recv(&ok, 1, MPI_INT, 0, 0, children, MPI_STATUS_IGNORE);
            look_up("rpmi-child-svc", "child-port", 12);
            check(MPI_Unpublish_name("rpmi-spawner-svc", MPI_INFO_NULL, "spawner-port") == MPI_SUCCESS, 14,
                  "the spawner's unpublish failed");
            MPI_Send(&ok, 1, MPI_INT, 0, 1, children);
            printf("mpi_spawn_names: the children found the spawner's name, the spawner found the children's\n");
        }
        MPI_Comm_disconnect(&children);
    } else {
        if (rank == 0) {
            look_up("rpmi-spawner-svc", "spawner-port", 15);
            check(MPI_Publish_name("rpmi-child-svc", MPI_INFO_NULL, "child-port") == MPI_SUCCESS, 17,
                  "the children's publish failed");
            MPI_Send(&ok, 1, MPI_INT, 0, 0, parent);
            MPI_Recv(&ok, 1, MPI_INT, 0, 1, parent, MPI_STATUS_IGNORE);
            check(MPI_Unpublish_name("rpmi-child-svc", MPI_INFO_NULL, "child-port") == MPI_SUCCESS, 18,
                  "the children's unpublish failed");
        }
        MPI_Comm_disconnect(&parent);
    }
    MPI_Finalize();
    return 0;
}
