/* The heat-equation simulation of heat.py, in C with libmelissa_dl.
 *
 * The same scheme as solver.py (backward Euler solved exactly by fast
 * diagonalisation in the sine basis, float64 arithmetic, float32 output; see
 * its docstring), so that for the same parameters it sends the fields the
 * Python solver computes, to rounding. Each MPI rank owns the rows
 * split_rows(nx, size, rank) and sends them as a 1-D slice of (rows x ny)
 * elements in row-major order; the server concatenates the slices.
 *
 *     mpirun -n 2 heat_c [--nx 32] [--ny 32] [--steps 100] [--dt 0.001]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <melissa_dl.h>

enum { PARAMETERS = 5 };

/* Rank ``rank``'s rows [*start, *stop) of ``n`` among ``size`` ranks (solver.split_rows). */
static void split_rows(int n, int size, int rank, int *start, int *stop) {
    int base = n / size, extra = n % size;
    *start = rank * base + (rank < extra ? rank : extra);
    *stop = *start + base + (rank < extra ? 1 : 0);
}

/* c (n x m) = a (n x k) @ b (k x m), all row-major. */
static void matmul(const double *a, const double *b, double *c, int n, int k, int m) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < m; j++) {
            double sum = 0;
            for (int l = 0; l < k; l++)
                sum += a[i * k + l] * b[l * m + j];
            c[i * m + j] = sum;
        }
}

/* The (n x n-2) sine basis of the 1-D Dirichlet Laplacian, zero on the two
 * boundary rows, and its eigenvalues mu[n-2] (solver._sine_basis). */
static void sine_basis(int n, double *s, double *mu) {
    int m = n - 2;
    double h = 1.0 / (n - 1);
    memset(s, 0, sizeof *s * (size_t)n * (size_t)m);
    for (int i = 1; i <= m; i++)
        for (int k = 1; k <= m; k++)
            s[i * m + k - 1] = sqrt(2.0 / (m + 1)) * sin(M_PI * (i * k) / (m + 1));
    for (int k = 1; k <= m; k++) {
        double g = sin(M_PI * k / (2 * (m + 1)));
        mu[k - 1] = 4.0 / (h * h) * (g * g);
    }
}

/* out (n x m) = a^T where a is (m x n). */
static void transpose(const double *a, double *out, int m, int n) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++)
            out[j * m + i] = a[i * n + j];
}

/* u_hat = Sx_int^T @ u @ Sy_int for an interior array u (mx x my). */
static void to_sine(const double *sx, const double *sy, const double *u, double *u_hat, int nx, int ny) {
    int mx = nx - 2, my = ny - 2;
    double *sxt = malloc(sizeof(double) * mx * mx), *tmp = malloc(sizeof(double) * mx * my);
    transpose(sx + mx, sxt, mx, mx); /* rows 1..mx of sx */
    matmul(sxt, u, tmp, mx, mx, my);
    matmul(tmp, sy + my, u_hat, mx, my, my);
    free(sxt);
    free(tmp);
}

typedef struct {
    int nx, ny, rows;
    double *sx_local, *sy_t, *steady_local, *w_hat, *gain, *tmp, *local;
} solver;

static void setup(solver *s, const double p[PARAMETERS], int nx, int ny, double dt, int start, int stop) {
    double alpha = 1.0, initial = p[0], left = p[1], right = p[2], bottom = p[3], top = p[4];
    int mx = nx - 2, my = ny - 2;
    double *sx = malloc(sizeof(double) * nx * mx), *sy = malloc(sizeof(double) * ny * my);
    double *mux = malloc(sizeof(double) * mx), *muy = malloc(sizeof(double) * my);
    sine_basis(nx, sx, mux);
    sine_basis(ny, sy, muy);
    double hx2 = pow(nx - 1, -2), hy2 = pow(ny - 1, -2);

    /* Boundary source b of the interior system -A u = b, then the steady state in the sine basis. */
    double *b = calloc((size_t)mx * my, sizeof(double)), *steady_hat = malloc(sizeof(double) * mx * my);
    for (int j = 0; j < my; j++) {
        b[j] += left / hx2;
        b[(mx - 1) * my + j] += right / hx2;
    }
    for (int i = 0; i < mx; i++) {
        b[i * my] += bottom / hy2;
        b[i * my + my - 1] += top / hy2;
    }
    to_sine(sx, sy, b, steady_hat, nx, ny);
    for (int i = 0; i < mx; i++)
        for (int j = 0; j < my; j++)
            steady_hat[i * my + j] /= mux[i] + muy[j];

    /* The steady state on the full grid; boundaries from the parameters, corners the mean of two edges. */
    s->sy_t = malloc(sizeof(double) * my * ny);
    transpose(sy, s->sy_t, ny, my);
    double *tmp = malloc(sizeof(double) * nx * my), *steady = malloc(sizeof(double) * nx * ny);
    matmul(sx, steady_hat, tmp, nx, mx, my);
    matmul(tmp, s->sy_t, steady, nx, my, ny);
    for (int j = 0; j < ny; j++) {
        steady[j] = left;
        steady[(nx - 1) * ny + j] = right;
    }
    for (int i = 0; i < nx; i++) {
        steady[i * ny] = bottom;
        steady[i * ny + ny - 1] = top;
    }
    steady[0] = (left + bottom) / 2;
    steady[ny - 1] = (left + top) / 2;
    steady[(nx - 1) * ny] = (right + bottom) / 2;
    steady[nx * ny - 1] = (right + top) / 2;

    /* The deviation from the steady state, in the sine basis, and its decay per step. */
    s->w_hat = malloc(sizeof(double) * mx * my);
    s->gain = malloc(sizeof(double) * mx * my);
    for (int k = 0; k < mx * my; k++)
        b[k] = initial;
    to_sine(sx, sy, b, s->w_hat, nx, ny);
    for (int i = 0; i < mx; i++)
        for (int j = 0; j < my; j++) {
            s->w_hat[i * my + j] -= steady_hat[i * my + j];
            s->gain[i * my + j] = 1.0 / (1.0 + dt * alpha * (mux[i] + muy[j]));
        }

    s->nx = nx;
    s->ny = ny;
    s->rows = stop - start;
    s->sx_local = malloc(sizeof(double) * s->rows * mx);
    s->steady_local = malloc(sizeof(double) * s->rows * ny);
    memcpy(s->sx_local, sx + start * mx, sizeof(double) * s->rows * mx);
    memcpy(s->steady_local, steady + start * ny, sizeof(double) * s->rows * ny);
    s->tmp = malloc(sizeof(double) * s->rows * my);
    s->local = malloc(sizeof(double) * s->rows * ny);
    free(sx);
    free(sy);
    free(mux);
    free(muy);
    free(b);
    free(steady_hat);
    free(tmp);
    free(steady);
}

/* Advance one step and write this rank's rows of the new field to out. */
static void step(solver *s, float *out) {
    int mx = s->nx - 2, my = s->ny - 2;
    for (int k = 0; k < mx * my; k++)
        s->w_hat[k] *= s->gain[k];
    matmul(s->sx_local, s->w_hat, s->tmp, s->rows, mx, my);
    matmul(s->tmp, s->sy_t, s->local, s->rows, my, s->ny);
    for (int k = 0; k < s->rows * s->ny; k++)
        out[k] = (float)(s->steady_local[k] + s->local[k]);
}

/* The library never exits: the simulation decides, here by ending the whole MPI job. */
static void check(int status) {
    if (status != MELISSA_DL_OK) {
        fprintf(stderr, "heat_c: melissa_dl error %d: %s\n", status, melissa_dl_error_message());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

static int usage(const char *program) {
    fprintf(stderr, "usage: %s [--nx N] [--ny N] [--steps N] [--dt DT]\n", program);
    return 2;
}

int main(int argc, char **argv) {
    int nx = 32, ny = 32, steps = 100;
    double dt = 1e-3;
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc)
            return usage(argv[0]);
        char *end;
        double value = strtod(argv[i + 1], &end);
        if (*end != '\0')
            return usage(argv[0]);
        if (strcmp(argv[i], "--nx") == 0)
            nx = (int)value;
        else if (strcmp(argv[i], "--ny") == 0)
            ny = (int)value;
        else if (strcmp(argv[i], "--steps") == 0)
            steps = (int)value;
        else if (strcmp(argv[i], "--dt") == 0)
            dt = value;
        else
            return usage(argv[0]);
    }
    if (nx < 3 || ny < 3 || steps < 0 || !(dt > 0))
        return usage(argv[0]);

    MPI_Init(&argc, &argv);
    int rank, size, start, stop, count;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    split_rows(nx, size, rank, &start, &stop);
    double p[PARAMETERS];
    check(melissa_dl_parameters(p, PARAMETERS, &count));
    if (count != PARAMETERS) {
        fprintf(stderr, "heat_c: expected %d parameters (initial, left, right, bottom, top), got %d\n", PARAMETERS,
                count);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    size_t local_count = (size_t)(stop - start) * (size_t)ny;
    check(melissa_dl_init("temperature", MELISSA_DL_FLOAT32, local_count, MPI_COMM_WORLD));

    solver s;
    setup(&s, p, nx, ny, dt, start, stop);
    float *field = malloc(sizeof(float) * local_count);
    for (int t = 0; t < steps; t++) {
        step(&s, field);
        check(melissa_dl_send_float("temperature", t, field, local_count));
    }
    check(melissa_dl_finalize());
    MPI_Finalize();
    return 0;
}
