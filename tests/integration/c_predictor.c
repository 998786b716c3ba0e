/* A C simulation that asks the model the study trains (melissa_dl_predict), for test_predictions.py.
 *
 *     c_predictor NX NY STEPS RECORD_FOLDER
 *
 * Sends STEPS steps of "temperature" (NX x NY float32, 100 + 10 t + the first parameter / 10), asking the model
 * once before the first (a serial program: MPI_COMM_NULL). Simulation 0 then asks until a model answers, asks
 * with a deadline of 1 ms (no answer: the study's serving.max_wait is longer), again (answered), and with an
 * output buffer of the wrong size (refused here). Writes what it was told to RECORD_FOLDER/c<id>.txt, a line
 * each: "first <status>", "answered <version> <mean of the field>", "late <status>", "again <status> <version>",
 * "wrong <code> <message>".
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <melissa_dl.h>

static void check(int code) {
    if (code != MELISSA_DL_OK) {
        fprintf(stderr, "c_predictor: %d %s\n", code, melissa_dl_error_message());
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 5)
        return 2;
    int nx = atoi(argv[1]), ny = atoi(argv[2]), steps = atoi(argv[3]), id, count;
    double p[5];
    check(melissa_dl_simulation(&id, NULL));
    check(melissa_dl_parameters(p, 5, &count));
    char path[4096];
    snprintf(path, sizeof path, "%s/c%d.txt", argv[4], id);
    FILE *record = fopen(path, "w");
    size_t n = (size_t)nx * (size_t)ny;
    float *field = malloc(n * sizeof *field), *answer = malloc(n * sizeof *answer);
    float parameters[5], time_step = (float)(steps - 1);
    for (int i = 0; i < 5; i++)
        parameters[i] = (float)p[i];
    const void *inputs[2] = {parameters, &time_step};
    void *outputs[1] = {answer};
    size_t bytes[1] = {n * sizeof *answer};
    int status;
    int64_t version = -1;
    check(melissa_dl_init("temperature", MELISSA_DL_FLOAT32, n, MPI_COMM_NULL));
    check(melissa_dl_predict(1, inputs, 1, outputs, bytes, 60, &status, &version));
    fprintf(record, "first %d\n", status);
    for (int t = 0; t < steps; t++) {
        for (size_t k = 0; k < n; k++)
            field[k] = (float)(100 + 10 * t + p[0] / 10);
        check(melissa_dl_send_float("temperature", t, field, n));
    }
    if (id == 0) {
        struct timespec pause = {0, 50000000};
        do {
            check(melissa_dl_predict(1, inputs, 1, outputs, bytes, 60, &status, &version));
            if (status != MELISSA_DL_ANSWERED)
                nanosleep(&pause, NULL); /* no model yet */
        } while (status != MELISSA_DL_ANSWERED);
        double mean = 0;
        for (size_t k = 0; k < n; k++)
            mean += answer[k] / (double)n;
        fprintf(record, "answered %lld %.3f\n", (long long)version, mean);
        check(melissa_dl_predict(1, inputs, 1, outputs, bytes, 0.001, &status, &version));
        fprintf(record, "late %d\n", status);
        check(melissa_dl_predict(1, inputs, 1, outputs, bytes, 60, &status, &version));
        fprintf(record, "again %d %lld\n", status, (long long)version);
        size_t wrong[1] = {bytes[0] / 2};
        int code = melissa_dl_predict(1, inputs, 1, outputs, wrong, 60, &status, &version);
        fprintf(record, "wrong %d %s\n", code, melissa_dl_error_message());
    }
    fclose(record);
    check(melissa_dl_finalize());
    free(field);
    free(answer);
    return 0;
}
