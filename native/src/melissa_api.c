/* Melissa's client API (include/melissa/api.h) on the melissa_dl client.
 *
 * Melissa's calls carry neither a time step nor an element count and return
 * nothing: this file keeps, per field, the count melissa_init declared and the
 * next step to send, and turns a failing call into one line on stderr and
 * exit(1). The launcher's output tail is the attempt's last lines, so a
 * "ClientError" there tells the study not to relaunch a simulation whose
 * program is at fault (melissa_dl/study/study.py, CLIENT_ERROR).
 */
#define _POSIX_C_SOURCE 200809L /* strdup */
#include "melissa/api.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "melissa_dl.h"

typedef struct {
    char *name;
    size_t count;
    int64_t next_step;
} melissa_field;

static melissa_field *fields;
static size_t nfields;

/* The codes of the program's own mistakes, which a relaunch would make again. */
static bool is_mistake(int code) {
    return (code >= MELISSA_DL_ERR_ENVIRONMENT && code <= MELISSA_DL_ERR_COUNT) || code == MELISSA_DL_ERR_MPI;
}

/* One line on stderr, written at once (the ranks of a simulation share its log), then exit(1). field is NULL for a
 * call without one. */
static _Noreturn void die(const char *call, const char *field, int code, const char *format, ...)
    __attribute__((format(printf, 4, 5)));

static _Noreturn void die(const char *call, const char *field, int code, const char *format, ...) {
    char message[1024], line[1400];
    va_list args;
    va_start(args, format);
    vsnprintf(message, sizeof message, format, args);
    va_end(args);
    int n = field ? snprintf(line, sizeof line, "%s('%.200s'): ", call, field)
                  : snprintf(line, sizeof line, "%s(): ", call);
    if (is_mistake(code))
        snprintf(line + n, sizeof line - (size_t)n, "ClientError: %s\n", message);
    else
        snprintf(line + n, sizeof line - (size_t)n, "melissa_dl error %d: %s\n", code, message);
    fputs(line, stderr);
    exit(EXIT_FAILURE);
}

static melissa_field *find(const char *name) {
    for (size_t i = 0; name != NULL && i < nfields; i++)
        if (strcmp(fields[i].name, name) == 0)
            return &fields[i];
    return NULL;
}

static _Noreturn void undeclared(const char *name) {
    if (name == NULL)
        die("melissa_send", "", MELISSA_DL_ERR_ARGUMENT, "the field name is NULL");
    if (nfields == 0)
        die("melissa_send", name, MELISSA_DL_ERR_STATE, "no field is declared: call melissa_init first");
    char declared[512] = "";
    for (size_t i = 0; i < nfields; i++)
        snprintf(declared + strlen(declared), sizeof declared - strlen(declared), "%s'%s'", i ? ", " : "",
                 fields[i].name);
    die("melissa_send", name, MELISSA_DL_ERR_UNDECLARED, "field '%s' was not declared by melissa_init (declared: %s)",
        name, declared);
}

MELISSA_DL_API void melissa_init(const char *field_name, const int local_vect_size, MPI_Comm comm) {
    const char *shown = field_name ? field_name : "";
    if (local_vect_size < 0)
        die("melissa_init", shown, MELISSA_DL_ERR_ARGUMENT, "field '%s': negative size %d", shown, local_vect_size);
    int code = melissa_dl_init(field_name, MELISSA_DL_FLOAT64, (size_t)local_vect_size, comm);
    if (code != MELISSA_DL_OK)
        die("melissa_init", shown, code, "%s", melissa_dl_error_message());
    melissa_field *more = realloc(fields, (nfields + 1) * sizeof *fields);
    char *name = strdup(field_name);
    if (more == NULL || name == NULL)
        die("melissa_init", shown, MELISSA_DL_ERR_SYSTEM, "out of memory");
    fields = more;
    fields[nfields++] = (melissa_field){name, (size_t)local_vect_size, 0};
}

MELISSA_DL_API void melissa_init_f(const char *field_name, int *local_vect_size, MPI_Fint *comm_fortran) {
    melissa_init(field_name, *local_vect_size, MPI_Comm_f2c(*comm_fortran));
}

MELISSA_DL_API void melissa_send(const char *field_name, const double *send_vect) {
    melissa_field *field = find(field_name);
    if (field == NULL)
        undeclared(field_name);
    int code = melissa_dl_send_double(field_name, field->next_step, send_vect, field->count);
    if (code != MELISSA_DL_OK)
        die("melissa_send", field_name, code, "%s", melissa_dl_error_message());
    field->next_step++;
}

/* melissa_send for the Fortran API's melissa_send (fortran/melissa_api.f90), which cannot bind to a C function of
 * its own name: the name is a Fortran procedure's there. */
MELISSA_DL_API void melissa_send_f(const char *field_name, const double *send_vect) {
    melissa_send(field_name, send_vect);
}

MELISSA_DL_API void melissa_finalize(void) {
    int code = melissa_dl_finalize();
    for (size_t i = 0; i < nfields; i++)
        free(fields[i].name);
    free(fields);
    fields = NULL;
    nfields = 0;
    if (code != MELISSA_DL_OK)
        die("melissa_finalize", NULL, code, "%s", melissa_dl_error_message());
}
