/* The C sender of bench/ingest.py: declares one float32 field of --count
 * elements, prints "ready", waits for a line on stdin, then sends --steps
 * steps and finalizes, so that all senders start at once. */
#include <stdio.h>
#include <stdlib.h>

#include <melissa_dl.h>

static int check(int status) {
    if (status != MELISSA_DL_OK)
        fprintf(stderr, "ingest_client: melissa_dl error %d: %s\n", status, melissa_dl_error_message());
    return status;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s STEPS COUNT\n", argv[0]);
        return 2;
    }
    int steps = atoi(argv[1]);
    size_t count = (size_t)atol(argv[2]);
    MPI_Init(&argc, &argv);
    float *payload = malloc(count * sizeof *payload);
    for (size_t i = 0; i < count; i++)
        payload[i] = 1;
    int status = check(melissa_dl_init("field", MELISSA_DL_FLOAT32, count, MPI_COMM_WORLD));
    printf("ready\n");
    fflush(stdout);
    if (getchar() == EOF)
        status = 1;
    for (int t = 0; status == MELISSA_DL_OK && t < steps; t++)
        status = check(melissa_dl_send_float("field", t, payload, count));
    if (status == MELISSA_DL_OK)
        status = check(melissa_dl_finalize());
    free(payload);
    MPI_Finalize();
    return status == MELISSA_DL_OK ? 0 : 1;
}
