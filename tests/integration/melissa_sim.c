/* A simulation written to Melissa's client API as Melissa documents it (tests/integration/test_melissa_api.py):
 * its parameters on the command line, melissa_init once per field, melissa_send once per field and step,
 * melissa_finalize; built with `mpicc melissa_sim.c $(pkg-config --cflags --libs melissa_dl)`.
 *
 *     melissa_sim STEPS A B
 *
 * The field "u" has 11 values decomposed over the ranks of MPI_COMM_WORLD in blocks (5 and 6 on 2 ranks) and
 * holds u_i = A i + B t at step t (i the global index); "mark" has one value per rank, 100 rank + t.
 */
#include <stdio.h>
#include <stdlib.h>

#include <melissa/api.h>

enum { GLOBAL = 11 };

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: melissa_sim STEPS A B\n");
        return 2;
    }
    int steps = atoi(argv[1]);
    double a = strtod(argv[2], NULL), b = strtod(argv[3], NULL);
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int first = rank * GLOBAL / size, local = (rank + 1) * GLOBAL / size - first;
    double u[GLOBAL], mark;
    melissa_init("u", local, MPI_COMM_WORLD);
    melissa_init("mark", 1, MPI_COMM_WORLD);
    for (int t = 0; t < steps; t++) {
        for (int i = 0; i < local; i++)
            u[i] = a * (first + i) + b * t;
        mark = 100.0 * rank + t;
        melissa_send("u", u);
        melissa_send("mark", &mark);
    }
    melissa_finalize();
    MPI_Finalize();
    return 0;
}
