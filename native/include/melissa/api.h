/* Melissa's client API (INRIA Melissa, melissa_api.h), implemented on libmelissa_dl.
 *
 * A simulation written for Melissa compiles unchanged against this header
 * (also installed as <melissa_api.h>) and streams into a melissa_dl study:
 *
 *     melissa_init("temperature", local_size, MPI_COMM_WORLD);   // once per field
 *     for (int t = 0; t < steps; t++)
 *         melissa_send("temperature", u);                        // local_size doubles, step t
 *     melissa_finalize();
 *
 * The step is implicit: each melissa_send of a field sends that field's next
 * step, 0, 1, 2, ... Fields are float64 (Melissa has no other type). The
 * simulation's identity and the server come from the launcher's environment,
 * as for melissa_dl.h. Declare every field before the first send, which
 * performs the handshake with the server.
 *
 * These functions return nothing, as Melissa's do: on an error they print one
 * line to stderr naming the call, the field and what went wrong, and exit the
 * process with status 1. A mistake of the program (an undeclared field, a
 * call out of order, a missing MELISSA_* variable) says "ClientError", which
 * tells the server that a relaunch would fail the same way; so does a
 * handshake refused for what the program declares (a field's name, dtype or
 * shape, its size, the client ranks). A server that could not be reached, or
 * that refused for anything else, is relaunched up to launcher.max_retries
 * times. Use melissa_dl.h for error codes instead of exits, float32 fields or
 * explicit steps.
 */
#ifndef MELISSA_API_H
#define MELISSA_API_H

#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Declare a field of study.fields: the number of doubles this rank sends per
 * step, and the simulation's communicator (only its rank and size are used;
 * every field must be declared with the same one). */
void melissa_init(const char *field_name, const int local_vect_size, MPI_Comm comm);

/* melissa_init for Fortran: the size and communicator handle by reference. */
void melissa_init_f(const char *field_name, int *local_vect_size, MPI_Fint *comm_fortran);

/* Send this rank's local_vect_size values of the field as its next step; the
 * values are copied, so the caller may overwrite them at once. */
void melissa_send(const char *field_name, const double *send_vect);

/* Wait until the server holds every step sent, and release everything. */
void melissa_finalize(void);

#ifdef __cplusplus
}
#endif

#endif
