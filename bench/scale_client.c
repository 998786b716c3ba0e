/* The simulation of bench/scale.py and tests/integration/test_scale.py:
 * declares one float32 field of COUNT elements, then sends STEPS steps,
 * pausing PAUSE seconds before each (a solver's time step, which keeps it and
 * its connections open meanwhile), and finalizes. Step t of simulation s holds
 * s + t everywhere. With GO_FILE, the first step waits until that file exists,
 * so that a test can hold every simulation of a wave running at once. A serial
 * program: MPI_COMM_NULL, no MPI_Init (which would cost it about 20 ms). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include <melissa_dl.h>

static int check(int status) {
    if (status != MELISSA_DL_OK)
        fprintf(stderr, "scale_client: melissa_dl error %d: %s\n", status, melissa_dl_error_message());
    return status;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: %s STEPS COUNT PAUSE [GO_FILE]\n", argv[0]);
        return 2;
    }
    int steps = atoi(argv[1]);
    size_t count = (size_t)atol(argv[2]);
    double pause = atof(argv[3]);
    struct timespec wait = {(time_t)pause, (long)((pause - (double)(time_t)pause) * 1e9)};
    int simulation = 0, attempt = 0;
    float *payload = malloc(count * sizeof *payload);
    int status = check(melissa_dl_simulation(&simulation, &attempt));
    if (status == MELISSA_DL_OK)
        status = check(melissa_dl_init("field", MELISSA_DL_FLOAT32, count, MPI_COMM_NULL));
    while (argc == 5 && access(argv[4], F_OK) != 0)
        nanosleep(&(struct timespec){0, 50 * 1000 * 1000}, NULL);
    for (int t = 0; status == MELISSA_DL_OK && t < steps; t++) {
        nanosleep(&wait, NULL);
        for (size_t i = 0; i < count; i++)
            payload[i] = (float)(simulation + t);
        status = check(melissa_dl_send_float("field", t, payload, count));
    }
    if (status == MELISSA_DL_OK)
        status = check(melissa_dl_finalize());
    free(payload);
    return status == MELISSA_DL_OK ? 0 : 1;
}
