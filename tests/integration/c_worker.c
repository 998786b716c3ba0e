/* A persistent worker in C for the integration tests (tests/integration/test_native_workers.py), built with
 * `mpicc c_worker.c $(pkg-config --cflags --libs melissa_dl)`: one process, simulation after simulation.
 *
 *     c_worker [--mpi] [--steps N] [--count N] [--crash-simulation S] [--dry] [--show NAME] [--record DIR]
 *
 * Every rank prints "worker PID" once at its start, then, for each simulation melissa_dl_next hands it,
 * "simulation S attempt A rank R parameters: P..." and streams --steps steps of the float32 field "field",
 * --count elements per rank, of value 1000 S + t + R / 2 (as c_client and toy_sim.py do). Rank 0 first reports
 * what melissa_dl_next says between melissa_dl_init and the first send ("next while declared: <code>
 * <message>"). --crash-simulation S: every rank dies (exit code 1) at step 3 of simulation S's first attempt.
 * --mpi: on MPI_COMM_WORLD (without it, a serial program on MPI_COMM_NULL, MPI never initialised). --dry: no
 * init, no sends, only the loop (against a stub handshake service); --show NAME prints "NAME=VALUE" (or "NAME
 * unset") with each simulation. Once the loop ends, every rank asks once more ("after the end: <code> more
 * <more>") and prints "over". A failing call prints "c_worker rank R: melissa_dl error <code>: <message>" on
 * stderr and exits 1 (after MPI_Finalize when melissa_dl_next failed, as it does on every rank alike).
 * --record DIR: every process also writes what it prints on stdout to DIR/worker<PID>.txt, flushed line by
 * line. The tests count what each rank was handed from these files: a rank's line forwarded through mpirun's
 * stdout once never reached the worker's log (CI, under load), though the rank had streamed its simulation.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <melissa_dl.h>

static int rank = 0, mpi = 0;
static FILE *record = NULL;

/* printf, and the same into the --record file */
static void say(const char *format, ...) {
    va_list args;
    va_start(args, format);
    vprintf(format, args);
    va_end(args);
    if (record != NULL) {
        va_start(args, format);
        vfprintf(record, format, args);
        va_end(args);
    }
}

static void flush(void) {
    fflush(stdout);
    if (record != NULL)
        fflush(record);
}

static void check(int status) {
    if (status != MELISSA_DL_OK) {
        fprintf(stderr, "c_worker rank %d: melissa_dl error %d: %s\n", rank, status, melissa_dl_error_message());
        exit(1);
    }
}

/* melissa_dl_next fails on every rank alike: each says so before mpirun sees one exit. */
static void check_next(int status) {
    if (status != MELISSA_DL_OK && mpi)
        MPI_Finalize();
    check(status);
}

int main(int argc, char **argv) {
    int steps = 10, count = 32, crash = -1, dry = 0;
    const char *show = NULL, *record_dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--mpi") == 0)
            mpi = 1;
        else if (strcmp(argv[i], "--dry") == 0)
            dry = 1;
        else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--count") == 0 && i + 1 < argc)
            count = atoi(argv[++i]);
        else if (strcmp(argv[i], "--crash-simulation") == 0 && i + 1 < argc)
            crash = atoi(argv[++i]);
        else if (strcmp(argv[i], "--show") == 0 && i + 1 < argc)
            show = argv[++i];
        else if (strcmp(argv[i], "--record") == 0 && i + 1 < argc)
            record_dir = argv[++i];
        else {
            fprintf(stderr, "c_worker: unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    MPI_Comm comm = MPI_COMM_NULL;
    if (mpi) {
        MPI_Init(&argc, &argv);
        comm = MPI_COMM_WORLD;
        MPI_Comm_rank(comm, &rank);
    }
    if (record_dir != NULL) {
        char path[4096];
        snprintf(path, sizeof path, "%s/worker%d.txt", record_dir, (int)getpid());
        if ((record = fopen(path, "a")) == NULL) {
            perror(path);
            return 2;
        }
    }
    say("worker %d\n", (int)getpid());
    flush();
    float *data = malloc(sizeof *data * (size_t)(count > 0 ? count : 1));
    int more;
    for (;;) {
        check_next(melissa_dl_next(comm, &more));
        if (!more)
            break;
        int simulation, attempt, n;
        double parameters[16];
        check(melissa_dl_simulation(&simulation, &attempt));
        check(melissa_dl_parameters(parameters, 16, &n));
        say("simulation %d attempt %d rank %d parameters:", simulation, attempt, rank);
        for (int i = 0; i < n; i++)
            say(" %.17g", parameters[i]);
        say("\n");
        if (show != NULL && getenv(show) != NULL)
            say("%s=%s\n", show, getenv(show));
        else if (show != NULL)
            say("%s unset\n", show);
        flush();
        if (dry)
            continue;
        check(melissa_dl_init("field", MELISSA_DL_FLOAT32, (size_t)count, comm));
        int status = melissa_dl_next(comm, &more);
        if (rank == 0)
            say("next while declared: %d %s more %d\n", status, melissa_dl_error_message(), more);
        flush();
        for (int t = 0; t < steps; t++) {
            if (simulation == crash && attempt == 0 && t == 3) {
                if (mpi) /* together: every rank has said which simulation it had */
                    MPI_Barrier(comm);
                fprintf(stderr, "c_worker: crashing on purpose at step 3\n");
                exit(1);
            }
            for (int i = 0; i < count; i++)
                data[i] = (float)(1000.0 * simulation + t + 0.5 * rank);
            check(melissa_dl_send_float("field", t, data, (size_t)count));
        }
        check(melissa_dl_finalize());
    }
    int status = melissa_dl_next(comm, &more);
    say("after the end: %d more %d\nover\n", status, more);
    flush();
    free(data);
    if (mpi)
        MPI_Finalize();
    return 0;
}
