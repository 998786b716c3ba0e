/* tests/integration/block_sim.py in C: each rank of a grid of ranks (DIMS, their product the MPI size) holds a
 * block of a GLOBAL array (uneven where the sizes do not divide) and sends it as its block of float32 field "p"
 * (melissa_dl_init_block). Step t of simulation s holds, at global index i, 10 s + 0.5 t + sum_d (d + 1) 0.01 i_d.
 *
 *     block_client STEPS NDIM GLOBAL... DIMS...     e.g. block_client 3 3  7 6 5  2 2 2
 */
#include <stdio.h>
#include <stdlib.h>

#include <melissa_dl.h>

static int check(int status) {
    if (status != MELISSA_DL_OK)
        fprintf(stderr, "block_client: melissa_dl error %d: %s\n", status, melissa_dl_error_message());
    return status;
}

int main(int argc, char **argv) {
    if (argc < 3 || argc != 3 + 2 * atoi(argv[2])) {
        fprintf(stderr, "usage: %s STEPS NDIM GLOBAL... DIMS...\n", argv[0]);
        return 2;
    }
    int steps = atoi(argv[1]), ndim = atoi(argv[2]), rank = 0, size = 1, simulation = 0;
    size_t whole[MELISSA_DL_MAX_NDIM], start[MELISSA_DL_MAX_NDIM], shape[MELISSA_DL_MAX_NDIM], count = 1;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    for (int d = ndim - 1, rest = rank; d >= 0; d--) { /* the last axis varies fastest, as numpy's unravel_index */
        size_t n = (size_t)atol(argv[3 + d]), parts = (size_t)atol(argv[3 + ndim + d]), index = (size_t)rest % parts;
        rest /= (int)parts;
        whole[d] = n;
        start[d] = index * (n / parts) + (index < n % parts ? index : n % parts);
        shape[d] = n / parts + (index < n % parts);
        count *= shape[d];
    }
    float *block = malloc((count ? count : 1) * sizeof *block);
    int status = check(melissa_dl_simulation(&simulation, NULL));
    if (status == MELISSA_DL_OK)
        status = check(melissa_dl_init_block("p", MELISSA_DL_FLOAT32, ndim, whole, start, shape, MPI_COMM_WORLD));
    for (int t = 0; status == MELISSA_DL_OK && t < steps; t++) {
        for (size_t flat = 0; flat < count; flat++) {
            double space = 0.0;
            for (int d = ndim - 1, rest = (int)flat; d >= 0; d--) {
                space += (d + 1) * 0.01 * (double)(start[d] + (size_t)rest % shape[d]);
                rest /= (int)shape[d];
            }
            block[flat] = (float)(10.0 * simulation + 0.5 * t + space);
        }
        status = check(melissa_dl_send_float("p", t, block, count));
    }
    if (status == MELISSA_DL_OK)
        status = check(melissa_dl_finalize());
    free(block);
    MPI_Finalize();
    return status == MELISSA_DL_OK ? 0 : 1;
}
