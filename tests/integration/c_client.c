/* A C simulation for the integration tests, linked statically to libmelissa_dl.
 *
 * Streams --steps steps of the float32 field "field" (or --field NAME),
 * --count elements per rank, of value 1000 s + t + rank / 2 (as toy_sim.py
 * does). With --parameter NAME (repeated), every rank first reads its
 * parameters by position and each NAME's by name, and rank 0 prints them
 * ("parameters: <values>", "parameter NAME: <value>"). With --errors,
 * the first attempt of simulation 0 first makes every mistake a C user can
 * make, and prints for each "<case>: <code> <message>", then behaves.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <melissa_dl.h>

static int steps = 10, count = 32;
static const char *field_name = "field";
enum { MAX_NAMES = 16 };
static const char *parameter_names[MAX_NAMES];
static int nnames = 0;

static void report(const char *name, int status) {
    printf("%s: %d %s\n", name, status, status == MELISSA_DL_OK ? "" : melissa_dl_error_message());
    fflush(stdout);
}

/* Declare "field" (and extra_field), with variable set to value unless it is
 * NULL, and report what the first send (the handshake) says; then release. */
static void handshake(const char *name, const char *variable, const char *value, const char *extra_field) {
    char *saved = variable ? strdup(getenv(variable)) : NULL;
    if (variable != NULL)
        setenv(variable, value, 1);
    float data[1] = {0};
    melissa_dl_init("field", MELISSA_DL_FLOAT32, 1, MPI_COMM_WORLD);
    if (extra_field != NULL)
        melissa_dl_init(extra_field, MELISSA_DL_FLOAT32, 1, MPI_COMM_WORLD);
    report(name, melissa_dl_send_float("field", 0, data, 1));
    report("send after that", melissa_dl_send_float("field", 0, data, 1));
    report("finalize after that", melissa_dl_finalize());
    if (variable != NULL)
        setenv(variable, saved, 1);
    free(saved);
}

/* Look up this simulation's parameters by position, then by the names of
 * --parameter, and print them if ``print``. */
static int print_parameters(int print) {
    double values[MAX_NAMES];
    int n, status = melissa_dl_parameters(values, MAX_NAMES, &n);
    if (status != MELISSA_DL_OK)
        return status;
    if (print) {
        printf("parameters:");
        for (int i = 0; i < n; i++)
            printf(" %.17g", values[i]);
        printf("\n");
    }
    for (int i = 0; status == MELISSA_DL_OK && i < nnames; i++) {
        double value;
        status = melissa_dl_parameter(parameter_names[i], &value);
        if (status == MELISSA_DL_OK && print)
            printf("parameter %s: %.17g\n", parameter_names[i], value);
    }
    fflush(stdout);
    return status;
}

/* Look up the parameter ``name`` with ``variable`` set to ``value`` (unset if
 * ``value`` is NULL; left alone if ``variable`` is), and report it. */
static void lookup(const char *case_name, const char *name, const char *variable, const char *value) {
    char *saved = variable && getenv(variable) ? strdup(getenv(variable)) : NULL;
    if (variable != NULL && value != NULL)
        setenv(variable, value, 1);
    else if (variable != NULL)
        unsetenv(variable);
    double found;
    report(case_name, melissa_dl_parameter(name, &found));
    if (saved != NULL)
        setenv(variable, saved, 1);
    free(saved);
}

/* Mistakes of melissa_dl_parameter (the study's parameters are "a" and "b"). */
static void parameter_mistakes(void) {
    lookup("unknown parameter", "x", NULL, NULL);
    lookup("NULL parameter name", NULL, NULL, NULL);
    lookup("no parameter names", "a", "MELISSA_PARAMETER_NAMES", NULL);
    lookup("names not strings", "a", "MELISSA_PARAMETER_NAMES", "[\"a\", 2]");
    lookup("fewer names than values", "a", "MELISSA_PARAMETER_NAMES", "[\"a\"]");
}

/* Mistakes before the simulation's own declaration; nothing is declared after them. */
static void handshake_mistakes(const float *data) {
    int protocol;
    const char *version = melissa_dl_version(&protocol);
    printf("version: %s protocol %d\n", version, protocol);
    parameter_mistakes();
    char *id = strdup(getenv("MELISSA_SIMULATION_ID"));
    unsetenv("MELISSA_SIMULATION_ID");
    report("no simulation id", melissa_dl_init("field", MELISSA_DL_FLOAT32, (size_t)count, MPI_COMM_WORLD));
    setenv("MELISSA_SIMULATION_ID", id, 1);
    free(id);
    report("send before init", melissa_dl_send_float("field", 0, data, (size_t)count));
    report("finalize before init", melissa_dl_finalize());
    report("unknown dtype", melissa_dl_init("field", 7, (size_t)count, MPI_COMM_WORLD));
    size_t whole[2] = {4, 8}, start[2] = {2, 0}, shape[2] = {3, 8};
    report("block outside", melissa_dl_init_block("field", MELISSA_DL_FLOAT32, 2, whole, start, shape, MPI_COMM_WORLD));
    report("block of 7 axes",
           melissa_dl_init_block("field", MELISSA_DL_FLOAT32, 7, whole, start, shape, MPI_COMM_WORLD));
    report("block without start", melissa_dl_init_block("field", MELISSA_DL_FLOAT32, 2, whole, NULL, shape,
                                                          MPI_COMM_WORLD));
    handshake("wrong token", "MELISSA_TOKEN", "00000000000000000000000000000000", NULL);
    handshake("unknown simulation", "MELISSA_SIMULATION_ID", "99", NULL); /* an unknown field would fail it for good */
    setenv("MELISSA_CLIENT_TIMEOUT", "0.5", 1);
    handshake("no server", "MELISSA_SERVER", "tcp://127.0.0.1:9", NULL);
    unsetenv("MELISSA_CLIENT_TIMEOUT");
}

/* Mistakes once "field" is declared; none changes the client. */
static void send_mistakes(const float *data) {
    report("declared twice", melissa_dl_init("field", MELISSA_DL_FLOAT32, (size_t)count, MPI_COMM_WORLD));
    report("undeclared field", melissa_dl_send_float("pressure", 0, data, (size_t)count));
    report("wrong count", melissa_dl_send_float("field", 0, data, (size_t)count - 1));
    report("wrong dtype", melissa_dl_send_double("field", 0, (const double *)data, (size_t)count / 2));
    report("negative step", melissa_dl_send_float("field", -1, data, (size_t)count));
}

int main(int argc, char **argv) {
    int errors = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--count") == 0 && i + 1 < argc)
            count = atoi(argv[++i]);
        else if (strcmp(argv[i], "--field") == 0 && i + 1 < argc)
            field_name = argv[++i];
        else if (strcmp(argv[i], "--parameter") == 0 && i + 1 < argc && nnames < MAX_NAMES)
            parameter_names[nnames++] = argv[++i];
        else if (strcmp(argv[i], "--errors") == 0)
            errors = 1;
        else {
            fprintf(stderr, "usage: %s [--steps N] [--count N] [--field NAME] [--parameter NAME]... [--errors]\n",
                    argv[0]);
            return 2;
        }
    }
    MPI_Init(&argc, &argv);
    int rank, simulation, attempt;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    float *data = calloc((size_t)count, sizeof *data);
    int status = melissa_dl_simulation(&simulation, &attempt);
    if (status == MELISSA_DL_OK && nnames > 0)
        status = print_parameters(rank == 0);
    int mistakes = errors && status == MELISSA_DL_OK && simulation == 0 && attempt == 0;
    if (mistakes)
        handshake_mistakes(data);
    if (status == MELISSA_DL_OK)
        status = melissa_dl_init(field_name, MELISSA_DL_FLOAT32, (size_t)count, MPI_COMM_WORLD);
    if (mistakes)
        send_mistakes(data);
    for (int t = 0; status == MELISSA_DL_OK && t < steps; t++) {
        for (int i = 0; i < count; i++)
            data[i] = (float)(simulation * 1000 + t + rank * 0.5);
        status = melissa_dl_send_float(field_name, t, data, (size_t)count);
        if (mistakes && t == 0)
            report("init after the first send", melissa_dl_init("late", MELISSA_DL_FLOAT32, 1, MPI_COMM_WORLD));
    }
    if (status == MELISSA_DL_OK)
        status = melissa_dl_finalize();
    if (status != MELISSA_DL_OK)
        fprintf(stderr, "c_client: melissa_dl error %d: %s\n", status, melissa_dl_error_message());
    free(data);
    MPI_Finalize();
    return status == MELISSA_DL_OK ? 0 : 1;
}
