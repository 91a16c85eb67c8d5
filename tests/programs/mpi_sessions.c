/* MPI sessions without MPI_Init: a communicator made from the session's WORLD process set, then one made by
 * the even ranks only from a subgroup. MPICH 5 builds each with PMI group barriers when its PMI server answers
 * 1.2 (a business-card exchange among the node roots of the group's ranks), and with MPI_COMM_WORLD
 * otherwise. Prints one line from rank 0 of WORLD once every check passed. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static void check(int rc, const char *what)
{
    if (rc != MPI_SUCCESS) {
        fprintf(stderr, "mpi_sessions: %s failed (%d)\n", what, rc);
        exit(1);
    }
}

int main(void)
{
    MPI_Session session;
    MPI_Group world_group, even_group;
    MPI_Comm world, even = MPI_COMM_NULL;
    check(MPI_Session_init(MPI_INFO_NULL, MPI_ERRORS_RETURN, &session), "MPI_Session_init");
    check(MPI_Group_from_session_pset(session, "mpi://WORLD", &world_group), "MPI_Group_from_session_pset");
    check(MPI_Comm_create_from_group(world_group, "org.rpmi.sessions.world", MPI_INFO_NULL, MPI_ERRORS_RETURN,
                                     &world),
          "MPI_Comm_create_from_group (world)");
    int rank, size;
    MPI_Comm_rank(world, &rank);
    MPI_Comm_size(world, &size);
    int sum = 0;
    check(MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, world), "MPI_Allreduce (world)");
    if (sum != size * (size - 1) / 2) {
        fprintf(stderr, "mpi_sessions: rank %d: world allreduce gave %d\n", rank, sum);
        return 1;
    }

    /* The even ranks, alone: the odd ones take no part in making it. */
    int evens = (size + 1) / 2, range[1][3] = {{0, size - 1, 2}};
    check(MPI_Group_range_incl(world_group, 1, range, &even_group), "MPI_Group_range_incl");
    if (rank % 2 == 0) {
        check(MPI_Comm_create_from_group(even_group, "org.rpmi.sessions.even", MPI_INFO_NULL, MPI_ERRORS_RETURN,
                                         &even),
              "MPI_Comm_create_from_group (even)");
        int n = 0, one = 1;
        check(MPI_Allreduce(&one, &n, 1, MPI_INT, MPI_SUM, even), "MPI_Allreduce (even)");
        if (n != evens) {
            fprintf(stderr, "mpi_sessions: rank %d: %d even ranks, expected %d\n", rank, n, evens);
            return 1;
        }
        MPI_Comm_free(&even);
    }
    check(MPI_Barrier(world), "MPI_Barrier (world)");
    if (rank == 0)
        printf("mpi_sessions: %d ranks, world and %d even ranks checked\n", size, evens);
    MPI_Group_free(&even_group);
    MPI_Group_free(&world_group);
    MPI_Comm_free(&world);
    check(MPI_Session_finalize(&session), "MPI_Session_finalize");
    return 0;
}
