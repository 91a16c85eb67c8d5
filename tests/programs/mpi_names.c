/* Name publishing: MPI_Publish_name, MPI_Lookup_name and MPI_Unpublish_name through the process manager.
 *
 *   mpi_names [SERVICE]
 *
 * Rank 0 opens a port and publishes it as SERVICE (default "rpmi-test-service"); every other rank looks it
 * up and compares it with rank 0's port. With MPI_ERRORS_RETURN, publishing SERVICE a second time, looking up
 * a name never published, and looking up SERVICE once it is unpublished must all fail.
 * Failed checks abort with codes 10 and up. */
#include <mpi.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void fail(int code, int rank, const char *what, const char *name, int err) {
    char text[MPI_MAX_ERROR_STRING] = "";
    int len;
    if (err != MPI_SUCCESS) MPI_Error_string(err, text, &len);
    fprintf(stderr, "mpi_names: rank %d: %s \"%s\" (returned %d%s%s)\n", rank, what, name, err, *text ? ": " : "",
            text);
    MPI_Abort(MPI_COMM_WORLD, code);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
    const char *service = argc > 1 ? argv[1] : "rpmi-test-service";
    char unknown[256];
    snprintf(unknown, sizeof unknown, "%s-never-published", service);
    char port[MPI_MAX_PORT_NAME] = "", found[MPI_MAX_PORT_NAME];
    int err;

    int opened = 0;
    if (rank == 0) {
        /* A netmod that cannot open ports (MPICH's ucx: 4.0's refuses, 5.0's port does not fit
         * MPI_MAX_PORT_NAME) gets a stand-in of the same shape: the name service only stores the text. */
        opened = MPI_Open_port(MPI_INFO_NULL, port) == MPI_SUCCESS;
        if (!opened) {
            snprintf(port, sizeof port, "tag#0$rpmi-stand-in-port#%d$", (int)getpid());
            fprintf(stderr, "mpi_names: MPI_Open_port failed, publishing the stand-in \"%s\"\n", port);
        }
        if ((err = MPI_Publish_name(service, MPI_INFO_NULL, port)) != MPI_SUCCESS) {
            fail(10, rank, "cannot publish", service, err);
        }
    }
    MPI_Bcast(port, MPI_MAX_PORT_NAME, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (rank != 0) {
        if ((err = MPI_Lookup_name(service, MPI_INFO_NULL, found)) != MPI_SUCCESS) {
            fail(11, rank, "cannot look up", service, err);
        }
        if (strcmp(found, port) != 0) {
            fprintf(stderr, "mpi_names: rank %d: looked up \"%s\", rank 0 published \"%s\"\n", rank, found, port);
            MPI_Abort(MPI_COMM_WORLD, 12);
        }
    } else {
        /* A name is published once: a second publish of it is refused. */
        if (MPI_Publish_name(service, MPI_INFO_NULL, port) == MPI_SUCCESS) {
            fail(13, rank, "a second publish succeeded for", service, MPI_SUCCESS);
        }
    }
    if (MPI_Lookup_name(unknown, MPI_INFO_NULL, found) == MPI_SUCCESS) {
        fail(14, rank, "a lookup succeeded for", unknown, MPI_SUCCESS);
    }
    /* Every lookup of the published name is done before rank 0 unpublishes it. */
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
        if ((err = MPI_Unpublish_name(service, MPI_INFO_NULL, port)) != MPI_SUCCESS) {
            fail(15, rank, "cannot unpublish", service, err);
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (MPI_Lookup_name(service, MPI_INFO_NULL, found) == MPI_SUCCESS) {
        fail(16, rank, "a lookup after unpublish succeeded for", service, MPI_SUCCESS);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
        if (opened) MPI_Close_port(port);
        printf("mpi_names: %d ranks looked up the port; duplicate publish, unknown and unpublished lookups failed\n",
               size - 1);
    }
    MPI_Finalize();
    return 0;
}
