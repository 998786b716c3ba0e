/* melissa_dl — stream the fields of an MPI simulation to a melissa_dl server.
 *
 * The C counterpart of the Python client (melissa_dl/wire/client.py), speaking the
 * same wire protocol. A simulation started by the server's launcher finds
 * everything it needs in its environment (MELISSA_SERVER, MELISSA_TOKEN,
 * MELISSA_SIMULATION_ID, MELISSA_ATTEMPT, MELISSA_PARAMETERS,
 * MELISSA_PARAMETER_NAMES, MELISSA_CLIENT_TIMEOUT, MELISSA_SEND_QUEUE_BYTES,
 * and the security level MELISSA_SECURITY with, for "curve",
 * MELISSA_CURVE_SERVER_KEY, MELISSA_CURVE_PUBLIC_KEY and
 * MELISSA_CURVE_SECRET_KEY):
 *
 *     double p[5], initial; int n;
 *     melissa_dl_parameters(p, 5, &n);                       // this simulation's parameter set
 *     melissa_dl_parameter("initial", &initial);             // one of them, by its name in the study
 *     melissa_dl_init("temperature", MELISSA_DL_FLOAT32, local_count, MPI_COMM_WORLD);
 *     for (int t = 0; t < steps; t++)
 *         melissa_dl_send_float("temperature", t, field, local_count);
 *     melissa_dl_finalize();
 *
 * Every function returns MELISSA_DL_OK (0) or an error code below, and
 * melissa_dl_error_message() then says what went wrong, naming the culprit;
 * the library never exits, aborts or prints. Declare every field of the
 * study with melissa_dl_init before the first send: the first send (or
 * finalize) performs the handshake with the server, so its errors are the
 * handshake's. In an MPI-parallel simulation every rank declares and sends its
 * own slice; the server concatenates the slices in rank order (a field
 * arrives as a 1-D array of the global element count). The library keeps one
 * connection per process and is not thread-safe: call it from one thread
 * (melissa_dl_next also changes the process's environment with setenv, which
 * no other thread may read or write meanwhile, getenv included).
 *
 * A program that pays a costly start (a mesh to read, a code to compile, a
 * GPU context) can run simulation after simulation in one process under
 * launcher.persistent: true, asking melissa_dl_next for each; the same loop
 * runs the single simulation of its environment without it:
 *
 *     int more;
 *     while (melissa_dl_next(MPI_COMM_WORLD, &more) == MELISSA_DL_OK && more) {
 *         melissa_dl_parameters(p, 5, &n);                   // this simulation's
 *         melissa_dl_init("temperature", MELISSA_DL_FLOAT32, local_count, MPI_COMM_WORLD);
 *         ...sends...
 *         melissa_dl_finalize();
 *     }
 */
#ifndef MELISSA_DL_H
#define MELISSA_DL_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MELISSA_DL_VERSION "0.1.0"      /* this header's library version */
#define MELISSA_DL_PROTOCOL_VERSION 4   /* the wire protocol it speaks */
#define MELISSA_DL_MAX_NDIM 6           /* dimensions of a field's block at most (melissa_dl_init_block) */

#if defined(__GNUC__)
#define MELISSA_DL_API __attribute__((visibility("default")))
#else
#define MELISSA_DL_API
#endif

/* Element types of a field (the protocol's dtype codes). */
enum melissa_dl_dtype {
    MELISSA_DL_FLOAT32 = 0,
    MELISSA_DL_FLOAT64 = 1
};

/* Return codes. */
enum melissa_dl_status {
    MELISSA_DL_OK = 0,
    MELISSA_DL_ERR_ENVIRONMENT = 1, /* a MELISSA_* variable is missing or malformed */
    MELISSA_DL_ERR_ARGUMENT = 2,    /* a bad argument: NULL or empty name, unknown dtype, step out of range, ... */
    MELISSA_DL_ERR_STATE = 3,       /* a call out of order, or after the connection failed */
    MELISSA_DL_ERR_UNDECLARED = 4,  /* send of a field that melissa_dl_init did not declare */
    MELISSA_DL_ERR_DTYPE = 5,       /* send of float data to a double field, or the reverse */
    MELISSA_DL_ERR_COUNT = 6,       /* send of another element count than declared */
    MELISSA_DL_ERR_REFUSED = 7,     /* the server refused the handshake or the credentials (the message says why) */
    MELISSA_DL_ERR_UNREACHABLE = 8, /* no answer, or a server rank unreachable, for MELISSA_CLIENT_TIMEOUT seconds */
    MELISSA_DL_ERR_PROTOCOL = 9,    /* the server's answer is not what the protocol says */
    MELISSA_DL_ERR_MPI = 10,        /* MPI is not initialised, or not linked: see melissa_dl_init */
    MELISSA_DL_ERR_SYSTEM = 11      /* out of memory, or a ZeroMQ failure */
};

/* The library's version ("0.1.0"); stores the protocol version in
 * *protocol_version unless it is NULL. */
MELISSA_DL_API const char *melissa_dl_version(int *protocol_version);

/* This simulation's id and attempt (0 on its first launch); either pointer may be NULL. */
MELISSA_DL_API int melissa_dl_simulation(int *simulation_id, int *attempt);

/* This simulation's parameter set: stores their number in *count and, unless
 * values is NULL, the parameters in values[0 .. *count - 1]
 * (MELISSA_DL_ERR_ARGUMENT if capacity < *count). */
MELISSA_DL_API int melissa_dl_parameters(double *values, int capacity, int *count);

/* This simulation's parameter called name (a name of study.parameters, from
 * MELISSA_PARAMETER_NAMES) in *value; *value is unchanged on failure
 * (MELISSA_DL_ERR_ARGUMENT for a name the study does not have,
 * MELISSA_DL_ERR_ENVIRONMENT if a launcher older than the names left
 * MELISSA_PARAMETER_NAMES unset: use melissa_dl_parameters then). */
MELISSA_DL_API int melissa_dl_parameter(const char *name, double *value);

/* Declare a field: its name in the study, its dtype and the number of
 * elements this rank sends per step. All fields share one communicator
 * (the same rank and size); comm is only asked for its rank and size.
 * A serial program may pass MPI_COMM_NULL without calling MPI_Init (one
 * rank): MPI_Init alone costs a process about 20 ms, which a study of many
 * short simulations feels. The library's MPI calls are weak symbols, so such
 * a program need not link MPI at all (then MELISSA_DL_ERR_MPI for any other
 * communicator). */
MELISSA_DL_API int melissa_dl_init(const char *field, int dtype, size_t local_count, MPI_Comm comm);

/* Declare a field split in blocks, instead of melissa_dl_init: this rank's
 * block of a global array of ndim dimensions (1 to 6), as ADIOS2's global
 * arrays describe it: global_shape, the block's start in it (0-based) and
 * its shape, each ndim long, in C order (the last axis varies fastest in the
 * data a send gives, whose count is the product of shape). A rank that holds
 * no block of the field gives a shape with a 0 and sends 0 elements. The
 * server places every rank's block in the global array (halos are not sent:
 * copy the interior out, or send from a solver array without them); the
 * handshake refuses blocks that overlap, leave a gap or disagree on the
 * global shape (MELISSA_DL_ERR_REFUSED, the message naming the ranks and the
 * region). melissa_dl_init's fields are 1-D slices stacked in rank order. */
MELISSA_DL_API int melissa_dl_init_block(const char *field, int dtype, int ndim, const size_t *global_shape,
                                         const size_t *start, const size_t *shape, MPI_Comm comm);

/* Send this rank's slice of a field at a time step (an integer in
 * [0, 2^32), e.g. 0, 1, 2, ...). The data is copied into ZeroMQ's queue, so
 * the caller may overwrite it at once; the call blocks while the server is
 * full, however long, and fails with MELISSA_DL_ERR_UNREACHABLE once the
 * server rank has been unreachable (no connection, no answer from its
 * delivery service) for MELISSA_CLIENT_TIMEOUT seconds. count must be the declared local count. */
MELISSA_DL_API int melissa_dl_send_float(const char *field, int64_t time_step, const float *data, size_t count);
MELISSA_DL_API int melissa_dl_send_double(const char *field, int64_t time_step, const double *data, size_t count);

/* Tell each server rank how many steps it should hold, wait until every
 * server rank confirms it has read every message sent to it (as long as the
 * server lives; MELISSA_DL_ERR_UNREACHABLE once a server rank has been
 * unreachable for MELISSA_CLIENT_TIMEOUT seconds, or lost messages with a
 * broken connection), and release everything: melissa_dl_init may then start
 * again. A program that exits after a successful finalize has lost nothing. A
 * simulation that ends without a successful finalize is relaunched by the
 * server. */
MELISSA_DL_API int melissa_dl_finalize(void);

/* The next simulation this process runs: sets *more to 1 when it has one
 * (melissa_dl_simulation, melissa_dl_parameters, melissa_dl_parameter and
 * melissa_dl_init then describe it), to 0 when the study is over or the call
 * fails. Call it on every rank of comm, outside a simulation (before
 * melissa_dl_init or after melissa_dl_finalize: MELISSA_DL_ERR_STATE in
 * between); once the study is over, later calls say 0 without asking.
 *
 * Without MELISSA_WORKER (no launcher.persistent) the first call gives the
 * simulation of the environment and the next one 0. A persistent worker
 * (MELISSA_WORKER, set by the launcher) asks rank 0's handshake service for
 * its next simulation, waiting while there is none yet; asking again ends the
 * simulation it had (one that did not finalize is relaunched by the server).
 * Rank 0 of comm asks and its answer reaches every rank of comm; the other
 * ranks wait on an MPI_Ibarrier they test every 10 ms, asleep meanwhile, so
 * that an idle worker burns no core. A serial program passes MPI_COMM_NULL
 * (see melissa_dl_init). The answer is applied to the process's environment
 * with setenv (the worker's environment at its start with the next
 * simulation's MELISSA_SIMULATION_ID, MELISSA_ATTEMPT, MELISSA_PARAMETERS,
 * ... on top), which the other calls read.
 *
 * MELISSA_DL_ERR_REFUSED if the service refuses the request or the
 * credentials, MELISSA_DL_ERR_UNREACHABLE without an answer for
 * MELISSA_CLIENT_TIMEOUT seconds, MELISSA_DL_ERR_PROTOCOL for an answer the
 * protocol does not know, MELISSA_DL_ERR_ENVIRONMENT for a missing or
 * malformed MELISSA_SERVER, MELISSA_TOKEN or security variable, and
 * MELISSA_DL_ERR_MPI as melissa_dl_init, MELISSA_DL_ERR_ARGUMENT for a NULL
 * more; every rank of comm returns rank 0's code and message. A program should
 * exit with a non-zero code when melissa_dl_next fails. A simulation whose
 * sends or finalize failed is relaunched by the server whether the program
 * exits (non-zero: at once) or asks for the next one (after a grace). */
MELISSA_DL_API int melissa_dl_next(MPI_Comm comm, int *more);

/* What melissa_dl_predict's *status says. */
enum melissa_dl_prediction {
    MELISSA_DL_ANSWERED = 0,  /* the outputs hold the model's answers */
    MELISSA_DL_NO_MODEL = 1,  /* the study has trained nothing yet (answered at once) */
    MELISSA_DL_NO_ANSWER = 2  /* none within the deadline (a late answer is dropped): use your own solver */
};

/* Ask the model the server is training (serving.online) n questions at once.
 * inputs[i] holds the n questions of the model's i-th prediction input, in
 * the order its prediction_inputs declare them (model.json's "inputs"), of
 * the declared element type, n x its shape in C order (a Fortran array of
 * the shape's reverse, then n: p(5, n) for an input of shape (5,)).
 * On MELISSA_DL_OK, *status says what came back: MELISSA_DL_ANSWERED with
 * outputs[j] holding the model's j-th output (in the order its predict
 * returns them, model.json's "outputs"), whose size must be exactly
 * output_bytes[j], and *version (unless NULL) the batches that model was
 * trained to; MELISSA_DL_NO_MODEL; or MELISSA_DL_NO_ANSWER after deadline
 * seconds (negative: the study's serving.deadline). The server ranks are
 * asked in turn. Performs the handshake if no send did yet.
 * MELISSA_DL_ERR_STATE without serving.online or declared fields,
 * MELISSA_DL_ERR_ARGUMENT for n outside 1..serving.max_batch, a NULL or
 * non-finite input, or an output buffer of another size (the message names
 * it), MELISSA_DL_ERR_REFUSED when a rank refuses the request (the message
 * says why) or our credentials.
 * A program that is no simulation of a study asks the final model that
 * melissa-server --serve OUTPUT_DIR serves with MELISSA_SERVING set to
 * OUTPUT_DIR/serving.json: no melissa_dl_init, no handshake;
 * melissa_dl_finalize releases the connection. */
MELISSA_DL_API int melissa_dl_predict(size_t n, const void *const *inputs, int noutputs, void *const *outputs,
                                      const size_t *output_bytes, double deadline, int *status, int64_t *version);

/* What the last failing call said ("" before any failure); successful calls
 * leave it unchanged. */
MELISSA_DL_API const char *melissa_dl_error_message(void);

/* For the Fortran module: melissa_dl_init with a Fortran communicator handle
 * (a negative count is refused), the send of either dtype, melissa_dl_next
 * with a Fortran communicator handle, and melissa_dl_init_block of a Fortran
 * array. */
MELISSA_DL_API int melissa_dl_init_fortran(const char *field, int dtype, int64_t local_count, MPI_Fint comm);
MELISSA_DL_API int melissa_dl_send_fortran(const char *field, int64_t time_step, const void *data, int64_t count,
                                           int dtype);
MELISSA_DL_API int melissa_dl_next_fortran(MPI_Fint comm, int *more);
/* melissa_dl_init_block of a Fortran array: the dimensions in the Fortran code's axis order and its data
 * column-major (the first axis varies fastest); the field has the code's axis order. */
MELISSA_DL_API int melissa_dl_init_block_fortran(const char *field, int dtype, int ndim, const int64_t *global_shape,
                                                 const int64_t *start, const int64_t *shape, MPI_Fint comm);

#ifdef __cplusplus
}
#endif

#endif
