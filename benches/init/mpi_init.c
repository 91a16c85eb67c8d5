/* The start-up and end of an MPI job and nothing else: what benches/init times. With MPI_INIT_TIMES set, each
 * process also says on stderr how long its MPI_Init took: "mpi-init: seconds=S", and tells the preloaded PMI
 * shim (pmi_time.c), where there is one, that MPI_Init has returned. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv) {
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    MPI_Init(&argc, &argv);
    clock_gettime(CLOCK_MONOTONIC, &end);
    if (getenv("MPI_INIT_TIMES")) {
        void (*mark)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "pmi_time_mark");
        if (mark)
            mark();
        fprintf(stderr, "mpi-init: seconds=%.6f\n",
                (double)(end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) / 1e9);
    }
    MPI_Finalize();
    return 0;
}
