/* The start-up and end of an MPI job and nothing else: what benches/init times. */
#include <mpi.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Finalize();
    return 0;
}
