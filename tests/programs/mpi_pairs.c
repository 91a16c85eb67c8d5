/* The end-to-end MPI program: MPI_Init, an Allreduce, a message between every pair of ranks, MPI_Finalize.
 * With an argument "abort=R:CODE", rank R calls MPI_Abort(MPI_COMM_WORLD, CODE) after MPI_Init.
 * With "hang=R", rank R never reaches the barrier (it sleeps), so others wait in one.
 * With "hang_before_init=R", rank R (by PMI_RANK) sleeps before MPI_Init, so the others wait in the PMI
 * barrier inside MPI_Init.
 * With "finalize_after=R:S", rank R sleeps S seconds after the line before MPI_Finalize, so the others wait for
 * it in theirs. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    const char *pmi_rank = getenv("PMI_RANK");
    for (int i = 1; i < argc; i++) {
        int r;
        if (pmi_rank && sscanf(argv[i], "hang_before_init=%d", &r) == 1 && r == atoi(pmi_rank)) {
            sleep(3600);
        }
    }
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    for (int i = 1; i < argc; i++) {
        int r, code;
        if (sscanf(argv[i], "abort=%d:%d", &r, &code) == 2 && r == rank) {
            MPI_Abort(MPI_COMM_WORLD, code);
        }
        if (sscanf(argv[i], "hang=%d", &r) == 1 && r == rank) {
            sleep(3600);
        }
    }
    long sum = 0, mine = rank + 1;
    MPI_Allreduce(&mine, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (sum != (long)size * (size + 1) / 2) {
        fprintf(stderr, "rank %d: allreduce gave %ld, expected %ld\n", rank, sum, (long)size * (size + 1) / 2);
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    /* Every pair exchanges one message: rank i sends its rank to every j and receives j's. */
    for (int peer = 0; peer < size; peer++) {
        if (peer == rank) continue;
        int out = rank, in = -1;
        MPI_Sendrecv(&out, 1, MPI_INT, peer, 7, &in, 1, MPI_INT, peer, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (in != peer) {
            fprintf(stderr, "rank %d: got %d from %d\n", rank, in, peer);
            MPI_Abort(MPI_COMM_WORLD, 4);
        }
    }
    char name[MPI_MAX_PROCESSOR_NAME];
    int len;
    MPI_Get_processor_name(name, &len);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) printf("mpi_pairs: %d ranks, allreduce %ld, all pairs exchanged\n", size, sum);
    for (int i = 1; i < argc; i++) {
        int r, seconds;
        if (sscanf(argv[i], "finalize_after=%d:%d", &r, &seconds) == 2 && r == rank) {
            fflush(stdout);
            sleep(seconds);
        }
    }
    MPI_Finalize();
    return 0;
}
