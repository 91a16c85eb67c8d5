/* MPMD: several commands started as one job, e.g. `mpiexec -n 2 mpi_mpmd a : -n 3 mpi_mpmd b`.
 *
 *   mpi_mpmd LABEL
 *
 * Every rank reads its MPI_APPNUM and sends (rank, appnum, LABEL) to rank 0, which prints one line per rank
 * ("rank 0 appnum 0 label a") and then how many ranks the one MPI_COMM_WORLD has. An Allreduce over
 * MPI_COMM_WORLD checks that all the commands' ranks are in it. Appnums must not decrease with the rank
 * (commands get consecutive ranks in order). Failed checks abort with codes 10 and up. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct entry {
    int rank, appnum;
    char label[32];
};

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc != 2 || strlen(argv[1]) >= sizeof(((struct entry *)0)->label)) {
        fprintf(stderr, "mpi_mpmd: rank %d: usage: mpi_mpmd LABEL (shorter than 32 bytes)\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int *appnum, flag;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag);
    if (!flag || *appnum < 0) {
        fprintf(stderr, "mpi_mpmd: rank %d: MPI_APPNUM %s %d\n", rank, flag ? "is" : "unset,", flag ? *appnum : -1);
        MPI_Abort(MPI_COMM_WORLD, 10);
    }
    long sum = 0, one = 1;
    MPI_Allreduce(&one, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (sum != size) {
        fprintf(stderr, "mpi_mpmd: rank %d: allreduce counted %ld ranks, world size %d\n", rank, sum, size);
        MPI_Abort(MPI_COMM_WORLD, 11);
    }
    struct entry mine = {rank, *appnum, ""};
    strcpy(mine.label, argv[1]);
    struct entry *all = rank == 0 ? malloc(size * sizeof *all) : NULL;
    MPI_Gather(&mine, sizeof mine, MPI_BYTE, all, sizeof mine, MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        for (int i = 0; i < size; i++) {
            if (all[i].rank != i || (i > 0 && all[i].appnum < all[i - 1].appnum)) {
                fprintf(stderr, "mpi_mpmd: entry %d is rank %d appnum %d (after appnum %d)\n", i, all[i].rank,
                        all[i].appnum, i > 0 ? all[i - 1].appnum : -1);
                MPI_Abort(MPI_COMM_WORLD, 12);
            }
            printf("rank %d appnum %d label %s\n", all[i].rank, all[i].appnum, all[i].label);
        }
        printf("mpi_mpmd: %d ranks in one MPI_COMM_WORLD\n", size);
        free(all);
    }
    MPI_Finalize();
    return 0;
}
