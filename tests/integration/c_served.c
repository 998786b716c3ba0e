/* Asks the model that melissa-server --serve serves (MELISSA_SERVING) one question of the heat surrogate, with no
 * study around: prints "<status> <version> <mean of the field>", or the error and exits 1.
 *
 *     MELISSA_SERVING=output/serving.json c_served NX NY
 */
#include <stdio.h>
#include <stdlib.h>

#include <melissa_dl.h>

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    size_t n = (size_t)atoi(argv[1]) * (size_t)atoi(argv[2]);
    float parameters[5] = {150, 250, 350, 450, 200}, time_step = 7;
    float *field = malloc(n * sizeof *field);
    const void *inputs[2] = {parameters, &time_step};
    void *outputs[1] = {field};
    size_t bytes[1] = {n * sizeof *field};
    int status;
    int64_t version = -1;
    int code = melissa_dl_predict(1, inputs, 1, outputs, bytes, 60, &status, &version);
    if (code != MELISSA_DL_OK) {
        fprintf(stderr, "c_served: %d %s\n", code, melissa_dl_error_message());
        return 1;
    }
    double mean = 0;
    for (size_t k = 0; k < n; k++)
        mean += field[k] / (double)n;
    printf("%d %lld %.6f\n", status, (long long)version, mean);
    free(field);
    return melissa_dl_finalize() == MELISSA_DL_OK ? 0 : 1;
}
