/* The C client: the wire protocol of melissa_dl/wire/protocol.py, the behaviour of
 * melissa_dl/wire/client.py (see melissa_dl.h for the API).
 *
 * One process holds one connection, a state machine of four phases:
 * EMPTY (nothing declared) -> DECLARED (melissa_dl_init) -> CONNECTED (the
 * first send or finalize did the handshake and declared the fields to every
 * server rank) -> EMPTY again after finalize. A failed handshake or a send
 * that found the server gone leaves it BROKEN: further sends are refused until
 * finalize releases everything. Mistakes of the caller (unknown field, wrong
 * dtype or count) change nothing, as in Python.
 *
 * Frames are built by hand, little-endian, field by field: the 67-byte header
 * is struct ``<4sHBB8sIIIHHHB6IQ`` of protocol.py. ZeroMQ copies the payload
 * (zmq_send), so the caller may reuse its array at once.
 *
 * Every socket carries the study's credentials (MELISSA_SECURITY: PLAIN with
 * the token, or CURVE with the MELISSA_CURVE_* keys) and a monitor (link.c).
 * As in Python, there is no send timeout: a full queue is waited out for as
 * long as the server lives, which the connection and the rank's delivery
 * service tell (melissa_dl/ingest/delivery.py: a DEALER socket per rank, asked every
 * keepalive seconds while a send is blocked; a question lost with its connection,
 * or unanswered for 1.5 keepalives, is asked again), and a server rank unreachable
 * for MELISSA_CLIENT_TIMEOUT seconds breaks the connection. Finalize waits
 * until every rank's delivery service confirms it read every message sent to
 * it (sending the FINALIZE again if its connection broke meanwhile), then
 * closes everything at once.
 */
#define _GNU_SOURCE /* clock_gettime, getrandom */
#include "melissa_dl.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "json.h"
#include "link.h"
#include "sha256.h"

enum { HEADER_BYTES = 75, KEY_BYTES = 8, MAX_NDIM = MELISSA_DL_MAX_NDIM, DTYPE_UINT8 = 7, MESSAGE_BYTES = 1024 };
/* The most payload one DATA message carries: a larger slice goes as consecutive parts (protocol 4). */
static const size_t PART_BYTES = (size_t)1 << 20;
enum { KIND_DATA = 1, KIND_DECLARE = 2, KIND_FINALIZE = 3 };

static const char *const DTYPE_NAMES[] = {"float32", "float64"};
static const size_t ITEM_BYTES[] = {4, 8};

typedef enum { EMPTY, DECLARED, CONNECTED, BROKEN } phase;

typedef struct {
    char *name;
    int dtype;
    size_t count;
    uint16_t id; /* its index in the study's fields, from the handshake */
    int ndim;    /* of a field split in blocks (melissa_dl_init_block); 0: a 1-D slice of count elements */
    size_t shape[MAX_NDIM], start[MAX_NDIM], global[MAX_NDIM]; /* this rank's block, where it starts, the whole */
    char order;  /* 'C', or 'F': the block's bytes in column-major order, a Fortran array's */
} field;

/* The distinct time steps sent, an open-addressing hash set (FINALIZE
 * announces, per server rank, how many distinct steps it was sent). */
typedef struct {
    uint64_t *slots; /* EMPTY_SLOT or a step */
    size_t capacity, size;
} step_set;

#define EMPTY_SLOT UINT64_MAX

enum { WAKE_MS = 1000, ANSWER_POLL_MS = 100 };
static const double MAX_KEEPALIVE = 5.0; /* melissa_dl.wire.protocol.MAX_KEEPALIVE */
static const double REASK = 1.5;         /* melissa_dl.wire.client.REASK */

/* A server rank's delivery service, asked one question at a time (_Questions in client.py); a question lost with
 * its connection, or unanswered for REASK keepalives, is asked again. */
typedef struct {
    mdl_link link;     /* a DEALER socket */
    double asked;      /* when the first question still unanswered was sent; 0: none open */
    double last_asked; /* when a question was last sent (or the link opened) */
    unsigned drops;    /* the link's drop count when a question was last sent */
} questions;

typedef struct {
    uint32_t simulation_id, attempt;
    char *endpoint;
    char *token;
    char *curve[3]; /* MELISSA_CURVE_SERVER_KEY, _PUBLIC_KEY, _SECRET_KEY, with MELISSA_SECURITY=curve */
    mdl_security security;
    uint8_t key[KEY_BYTES];
    double timeout;
    double queue_bytes;
} environment;

/* The server ranks' prediction services (serving.online; melissa_dl/wire/predictions.py), asked in turn from
 * this simulation's id, one request at a time; a rank's DEALER link is opened by the first question to it. */
typedef struct {
    size_t nranks;       /* 0: the server answers no predictions */
    char **endpoints;
    mdl_link *links;
    bool *opened;
    size_t ninputs;      /* the model's prediction inputs, in their declared order */
    char **names;
    int *dtypes;         /* index in PREDICT_DTYPES */
    int *ndims;
    size_t (*shapes)[MAX_NDIM];
    size_t *question_bytes; /* of one question of each input */
    size_t max_batch;
    double deadline;
    uint64_t asked;      /* requests sent: the last one's id */
} predictor;

static struct {
    phase phase;
    environment env;
    int rank, size;
    field *fields;
    size_t nfields;
    void *context;
    mdl_link *links; /* one PUSH socket per server rank */
    questions *asks; /* its delivery service, per server rank */
    uint64_t *sent;  /* messages sent to each server rank, as its delivery service counts them */
    size_t nlinks;
    bool bind_simulation;
    uint64_t block;   /* consecutive steps routed to one rank */
    uint64_t overlap; /* steps of the next block its rank also receives (windows of steps) */
    step_set steps;
    predictor predict;
    bool served;      /* asking a model that melissa-server --serve serves (MELISSA_SERVING), not a study's */
    char broken[MESSAGE_BYTES]; /* why the connection failed, while BROKEN */
} client;

static char last_message[MESSAGE_BYTES];

static int fail(int code, const char *format, ...) __attribute__((format(printf, 2, 3)));

static int fail(int code, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_message, sizeof last_message, format, args);
    va_end(args);
    return code;
}

/* -- growable strings ---------------------------------------------------- */

typedef struct {
    char *data;
    size_t size, capacity;
    bool failed; /* out of memory: the text is incomplete */
} strbuf;

static void sb_printf(strbuf *sb, const char *format, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(strbuf *sb, const char *format, ...) {
    for (;;) {
        va_list args;
        va_start(args, format);
        size_t room = sb->capacity - sb->size;
        int n = sb->failed ? -1 : vsnprintf(sb->data ? sb->data + sb->size : NULL, room, format, args);
        va_end(args);
        if (n < 0) {
            sb->failed = true;
            return;
        }
        if ((size_t)n < room) {
            sb->size += (size_t)n;
            return;
        }
        size_t capacity = 2 * (sb->size + (size_t)n + 1);
        char *data = realloc(sb->data, capacity);
        if (data == NULL) {
            sb->failed = true;
            return;
        }
        sb->data = data;
        sb->capacity = capacity;
    }
}

static void sb_json_string(strbuf *sb, const char *text) {
    sb_printf(sb, "\"");
    for (const unsigned char *c = (const unsigned char *)text; *c != '\0'; c++) {
        if (*c == '"' || *c == '\\')
            sb_printf(sb, "\\%c", *c);
        else if (*c < 0x20)
            sb_printf(sb, "\\u%04x", *c);
        else
            sb_printf(sb, "%c", *c);
    }
    sb_printf(sb, "\"");
}

/* [a,b,...] */
static void sb_dims(strbuf *sb, const size_t *dims, int ndim) {
    sb_printf(sb, "[");
    for (int d = 0; d < ndim; d++)
        sb_printf(sb, d ? ",%zu" : "%zu", dims[d]);
    sb_printf(sb, "]");
}

/* {"name":["float32",[count]],...}, a block's ["float32",[shape],{"start":[...],"global":[...],"order":"C"}] */
static void sb_fields(strbuf *sb) {
    sb_printf(sb, "{");
    for (size_t i = 0; i < client.nfields; i++) {
        const field *f = &client.fields[i];
        sb_printf(sb, i ? "," : "");
        sb_json_string(sb, f->name);
        sb_printf(sb, ":[\"%s\",", DTYPE_NAMES[f->dtype]);
        if (f->ndim == 0) {
            sb_dims(sb, &f->count, 1);
        } else {
            sb_dims(sb, f->shape, f->ndim);
            sb_printf(sb, ",{\"start\":");
            sb_dims(sb, f->start, f->ndim);
            sb_printf(sb, ",\"global\":");
            sb_dims(sb, f->global, f->ndim);
            sb_printf(sb, ",\"order\":\"%c\"}", f->order);
        }
        sb_printf(sb, "]");
    }
    sb_printf(sb, "}");
}

/* -- the environment ----------------------------------------------------- */

static int require(const char *name, const char **value) {
    *value = getenv(name);
    if (*value == NULL)
        return fail(MELISSA_DL_ERR_ENVIRONMENT, "%s is not set: start this simulation through melissa-server's launcher",
                    name);
    return MELISSA_DL_OK;
}

/* A number variable, read as JSON (so in the C locale), within [low, high];
 * ``fallback`` when unset, or required if ``fallback`` is NAN. The callers' bounds are
 * melissa_dl/config/limits.py's CLIENT_TIMEOUT_RANGE, SEND_QUEUE_BYTES_RANGE and MAX_SIMULATION_ID,
 * which the configuration checks at --check: change them together (tests/unit/config/test_config.py compares). */
static int env_number(const char *name, double fallback, double low, double high, bool integer, double *out) {
    const char *text = getenv(name);
    if (text == NULL) {
        if (isnan(fallback))
            return require(name, &text);
        *out = fallback;
        return MELISSA_DL_OK;
    }
    json_value value;
    bool ok = mdl_json_parse(text, strlen(text), &value);
    ok = ok && value.type == JSON_NUMBER && value.number >= low && value.number <= high &&
         (!integer || value.number == floor(value.number));
    *out = value.number;
    mdl_json_free(&value);
    if (!ok)
        return fail(MELISSA_DL_ERR_ENVIRONMENT, "%s='%s' is not %s in [%.15g, %.15g]", name, text,
                    integer ? "an integer" : "a number", low, high);
    return MELISSA_DL_OK;
}

/* The frames' key: HMAC-SHA256(token bytes, simulation id || attempt, each 4 bytes LE)[:8]. */
static int make_key(const char *token, uint32_t simulation_id, uint32_t attempt, uint8_t key[KEY_BYTES]) {
    size_t n = strlen(token) / 2;
    uint8_t *secret = malloc(n + 1);
    if (secret == NULL)
        return fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    bool ok = strlen(token) % 2 == 0;
    for (size_t i = 0; ok && i < n; i++) {
        int high = mdl_hex_digit(token[2 * i]), low = mdl_hex_digit(token[2 * i + 1]);
        ok = high >= 0 && low >= 0;
        if (ok)
            secret[i] = (uint8_t)(high << 4 | low);
    }
    uint8_t message[8] = {(uint8_t)simulation_id, (uint8_t)(simulation_id >> 8), (uint8_t)(simulation_id >> 16),
                          (uint8_t)(simulation_id >> 24), (uint8_t)attempt, (uint8_t)(attempt >> 8),
                          (uint8_t)(attempt >> 16), (uint8_t)(attempt >> 24)};
    uint8_t mac[SHA256_BYTES];
    if (ok)
        mdl_hmac_sha256(secret, n, message, sizeof message, mac);
    free(secret);
    if (!ok)
        return fail(MELISSA_DL_ERR_ENVIRONMENT, "MELISSA_TOKEN is not a hexadecimal string");
    memcpy(key, mac, KEY_BYTES);
    return MELISSA_DL_OK;
}

static void free_environment(environment *env) {
    free(env->endpoint);
    free(env->token);
    for (int i = 0; i < 3; i++)
        free(env->curve[i]);
    memset(env, 0, sizeof *env);
}

/* MELISSA_SECURITY (default token) and, for curve, the three Z85 keys. */
static int read_security(environment *env) {
    static const char *const KEYS[3] = {"MELISSA_CURVE_SERVER_KEY", "MELISSA_CURVE_PUBLIC_KEY",
                                        "MELISSA_CURVE_SECRET_KEY"};
    const char *level = getenv("MELISSA_SECURITY");
    if (level == NULL || strcmp(level, "token") == 0) {
        env->security.level = SECURITY_TOKEN;
        return MELISSA_DL_OK;
    }
    if (strcmp(level, "curve") != 0)
        return fail(MELISSA_DL_ERR_ENVIRONMENT, "MELISSA_SECURITY='%.50s' is neither 'token' nor 'curve'", level);
    env->security.level = SECURITY_CURVE;
    for (int i = 0; i < 3; i++) {
        const char *key = getenv(KEYS[i]);
        if (key == NULL || strlen(key) != 40)
            return fail(MELISSA_DL_ERR_ENVIRONMENT, "MELISSA_SECURITY=curve but %s is %s", KEYS[i],
                        key == NULL ? "not set" : "not a Z85 key");
        env->curve[i] = strdup(key);
        if (env->curve[i] == NULL)
            return fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    }
    return MELISSA_DL_OK;
}

static int simulation_ids(double *simulation_id, double *attempt) {
    int code = env_number("MELISSA_SIMULATION_ID", NAN, 0, INT32_MAX, true, simulation_id);
    if (code == MELISSA_DL_OK)
        code = env_number("MELISSA_ATTEMPT", 0, 0, INT32_MAX, true, attempt);
    return code;
}

/* What any request to rank 0's handshake service needs: MELISSA_SERVER, MELISSA_TOKEN,
 * MELISSA_CLIENT_TIMEOUT and the security level; *env is empty on failure. */
static int read_server(environment *env) {
    const char *endpoint, *token;
    int code = env_number("MELISSA_CLIENT_TIMEOUT", 300, 1e-3, 1e6, false, &env->timeout);
    if (code == MELISSA_DL_OK)
        code = require("MELISSA_SERVER", &endpoint);
    if (code == MELISSA_DL_OK)
        code = require("MELISSA_TOKEN", &token);
    if (code == MELISSA_DL_OK)
        code = read_security(env);
    if (code == MELISSA_DL_OK) {
        env->endpoint = strdup(endpoint);
        env->token = strdup(token);
        if (env->endpoint == NULL || env->token == NULL)
            code = fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    }
    if (code != MELISSA_DL_OK) {
        free_environment(env);
        return code;
    }
    env->security.token = env->token;
    for (int i = 0; i < 3; i++)
        env->security.curve[i] = env->curve[i];
    return MELISSA_DL_OK;
}

/* A simulation's environment: the server's, its id, attempt and key. */
static int read_environment(environment *env) {
    double simulation_id, attempt;
    int code = simulation_ids(&simulation_id, &attempt);
    if (code == MELISSA_DL_OK)
        code = env_number("MELISSA_SEND_QUEUE_BYTES", 64 << 20, 1, 1e18, true, &env->queue_bytes);
    if (code == MELISSA_DL_OK)
        code = read_server(env);
    if (code == MELISSA_DL_OK)
        code = make_key(env->token, (uint32_t)simulation_id, (uint32_t)attempt, env->key);
    if (code != MELISSA_DL_OK) {
        free_environment(env);
        return code;
    }
    env->simulation_id = (uint32_t)simulation_id;
    env->attempt = (uint32_t)attempt;
    return MELISSA_DL_OK;
}

/* -- the set of steps ---------------------------------------------------- */

static bool steps_add(step_set *set, uint32_t step) {
    if (2 * (set->size + 1) > set->capacity) { /* at most half full: short probes */
        size_t capacity = set->capacity ? 2 * set->capacity : 64;
        step_set bigger = {.slots = malloc(sizeof(uint64_t) * capacity), .capacity = capacity, .size = 0};
        if (bigger.slots == NULL)
            return false;
        for (size_t i = 0; i < bigger.capacity; i++)
            bigger.slots[i] = EMPTY_SLOT;
        for (size_t i = 0; i < set->capacity; i++)
            if (set->slots[i] != EMPTY_SLOT)
                steps_add(&bigger, (uint32_t)set->slots[i]);
        free(set->slots);
        *set = bigger;
    }
    size_t i = (step * (size_t)2654435761u) & (set->capacity - 1);
    while (set->slots[i] != EMPTY_SLOT && set->slots[i] != step)
        i = (i + 1) & (set->capacity - 1);
    if (set->slots[i] == EMPTY_SLOT) {
        set->slots[i] = step;
        set->size++;
    }
    return true;
}

/* -- frames -------------------------------------------------------------- */

/* The rank that owns a step: blocks of steps in turn over the ranks, or the simulation's rank when bound. */
static size_t owner_rank(uint32_t time_step) {
    uint64_t order = client.bind_simulation ? client.env.simulation_id
                                            : (uint64_t)client.env.simulation_id + time_step / client.block;
    return (size_t)(order % client.nlinks);
}

/* The ranks a step goes to (returns how many): its owner, then the previous block's owner when the step is in
   that block's overlap (wire.protocol.Route). */
static int step_ranks(uint32_t time_step, size_t ranks[2]) {
    ranks[0] = owner_rank(time_step);
    if (client.bind_simulation || client.nlinks == 1 || time_step < client.block ||
        time_step % client.block >= client.overlap)
        return 1;
    ranks[1] = (ranks[0] + client.nlinks - 1) % client.nlinks;
    return 2;
}

static uint8_t *put(uint8_t *at, uint64_t value, int bytes) {
    for (int i = 0; i < bytes; i++)
        *at++ = (uint8_t)(value >> (8 * i));
    return at;
}

static void pack_header(uint8_t out[HEADER_BYTES], int kind, uint32_t time_step, uint16_t field_id, int dtype,
                        const size_t *shape, int ndim, uint64_t payload_bytes, uint64_t offset) {
    uint8_t *at = out;
    memcpy(at, "MLDL", 4);
    at = put(at + 4, MELISSA_DL_PROTOCOL_VERSION, 2);
    at = put(at, (uint64_t)kind, 1);
    at = put(at, (uint64_t)dtype, 1);
    memcpy(at, client.env.key, KEY_BYTES);
    at = put(at + KEY_BYTES, client.env.simulation_id, 4);
    at = put(at, client.env.attempt, 4);
    at = put(at, time_step, 4);
    at = put(at, (uint64_t)client.rank, 2);
    at = put(at, (uint64_t)client.size, 2);
    at = put(at, field_id, 2);
    at = put(at, (uint64_t)ndim, 1);
    for (int i = 0; i < MAX_NDIM; i++)
        at = put(at, i < ndim ? shape[i] : 0, 4);
    at = put(at, payload_bytes, 8);
    put(at, offset, 8);
}

/* The connection failed with ``code``: refuse further sends, saying why. */
static int broken(int code) {
    client.phase = BROKEN;
    memcpy(client.broken, last_message, sizeof last_message);
    return code;
}

/* The server refused the link's credentials or mechanism: a deterministic failure. ``who`` names the asker
 * ("simulation 3", "worker 0:1"). */
static int refused(const mdl_link *link, const char *who, const environment *env) {
    char why[256];
    mdl_link_refusal(link, why, sizeof why);
    return fail(MELISSA_DL_ERR_REFUSED, "%s: %s: %s: this simulation's credentials (MELISSA_SECURITY=%s) are not "
                "the server's (a stale environment, or another study's server?)", who, link->endpoint, why,
                mdl_security_name(env->security.level));
}

/* "simulation 3": who asks in a simulation's errors. */
static const char *simulation_name(void) {
    static char name[32];
    if (client.served)
        return "predictor";
    snprintf(name, sizeof name, "simulation %u", client.env.simulation_id);
    return name;
}

/* MELISSA_DL_OK while a server rank lives: connected, and its delivery service not silent for the timeout. */
static int alive(size_t rank) {
    mdl_link *links[2] = {&client.links[rank], &client.asks[rank].link};
    double silent = client.asks[rank].asked > 0 ? mdl_now() - client.asks[rank].asked : 0;
    for (int i = 0; i < 2; i++) {
        mdl_link_update(links[i]);
        if (links[i]->refused)
            return refused(links[i], simulation_name(), &client.env);
        silent = fmax(silent, mdl_link_down_for(links[i]));
    }
    if (silent >= client.env.timeout)
        return fail(MELISSA_DL_ERR_UNREACHABLE, "simulation %u: server rank %zu (%s) has been unreachable for %g s "
                    "(no connection, no answer)", client.env.simulation_id, rank, client.links[rank].endpoint,
                    client.env.timeout);
    return MELISSA_DL_OK;
}

static double keepalive(void) {
    return fmin(MAX_KEEPALIVE, client.env.timeout / 4);
}

/* Ask a rank's delivery service how much it read of us (``wait``: answer once all of it, or at the keepalive) if
 * no question is open and ``every`` seconds passed since the last, or if the open one was lost: its connection
 * dropped, or it has been silent for REASK keepalives (the service answers within one). */
static void ask_rank(size_t rank, bool wait, double every) {
    questions *q = &client.asks[rank];
    mdl_link_update(&q->link);
    double since = mdl_now() - q->last_asked;
    bool due = q->asked > 0 ? q->link.drops > q->drops || since >= REASK * keepalive() : since >= every;
    if (!due)
        return;
    char question[512];
    char key[2 * KEY_BYTES + 1];
    for (int i = 0; i < KEY_BYTES; i++)
        snprintf(key + 2 * i, 3, "%02x", client.env.key[i]);
    int size = snprintf(question, sizeof question, "{\"simulation_id\":%u,\"attempt\":%u,\"client_rank\":%d,"
                        "\"key\":\"%s\",\"sent\":%llu,\"wait\":%s}", client.env.simulation_id, client.env.attempt,
                        client.rank, key, (unsigned long long)client.sent[rank], wait ? "true" : "false");
    /* a full queue: the rank is unreachable, which its silence tells */
    if (zmq_send(q->link.socket, question, (size_t)size, ZMQ_DONTWAIT) == size) {
        q->last_asked = mdl_now();
        q->drops = q->link.drops;
        if (q->asked == 0)
            q->asked = q->last_asked;
    }
}

/* The answer to a rank's open question, if it came: 1 (read, finalized, ended set), 0 (none yet), or a negative
 * MELISSA_DL_ERR_* code. */
static int answer(size_t rank, uint64_t *read, bool *finalized, bool *ended) {
    questions *q = &client.asks[rank];
    zmq_msg_t message;
    zmq_msg_init(&message);
    if (zmq_msg_recv(&message, q->link.socket, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&message);
        return 0;
    }
    q->asked = 0;
    json_value reply = {0};
    const json_value *r = NULL, *f = NULL, *e = NULL;
    if (mdl_json_parse(zmq_msg_data(&message), zmq_msg_size(&message), &reply) && reply.type == JSON_OBJECT) {
        r = mdl_json_get(&reply, "read");
        f = mdl_json_get(&reply, "finalized");
        e = mdl_json_get(&reply, "ended");
    }
    zmq_msg_close(&message);
    int code = 1;
    if (r && f && e && r->type == JSON_NUMBER && r->number >= 0 && f->type == JSON_BOOL && e->type == JSON_BOOL) {
        *read = (uint64_t)r->number;
        *finalized = f->boolean;
        *ended = e->boolean;
    } else {
        code = fail(MELISSA_DL_ERR_PROTOCOL, "simulation %u: server rank %zu's delivery service answered something "
                    "else than {read, finalized, ended}", client.env.simulation_id, rank);
    }
    mdl_json_free(&reply);
    return code;
}

/* While a send is blocked: ask the rank whether it lives, every keepalive seconds from the last question (ping in
 * client.py says why). */
static int ping(size_t rank) {
    uint64_t read;
    bool finalized, ended;
    int code = answer(rank, &read, &finalized, &ended);
    if (code < 0)
        return code;
    ask_rank(rank, false, keepalive());
    return MELISSA_DL_OK;
}

/* Send a two-frame message to a server rank; while its queue is full, wait as long as that rank lives. */
static int send_message(size_t rank, const uint8_t *header, const void *payload, size_t size) {
    mdl_link *link = &client.links[rank];
    for (;;) {
        /* a message's first part taken, ZeroMQ takes the rest: its queue counts whole messages */
        if (zmq_send(link->socket, header, HEADER_BYTES, ZMQ_SNDMORE | ZMQ_DONTWAIT) == HEADER_BYTES)
            break;
        if (errno != EAGAIN && errno != EINTR)
            return broken(fail(MELISSA_DL_ERR_SYSTEM, "simulation %u: zmq_send: %s", client.env.simulation_id,
                               zmq_strerror(errno)));
        int code = ping(rank);
        if (code == MELISSA_DL_OK)
            code = alive(rank);
        if (code != MELISSA_DL_OK)
            return broken(code);
        zmq_pollitem_t items[2] = {{link->socket, 0, ZMQ_POLLOUT, 0}, {link->monitor, 0, ZMQ_POLLIN, 0}};
        zmq_poll(items, 2, WAKE_MS);
    }
    while (zmq_send(link->socket, payload, size, 0) < 0)
        if (errno != EINTR)
            return broken(fail(MELISSA_DL_ERR_SYSTEM, "simulation %u: zmq_send: %s", client.env.simulation_id,
                               zmq_strerror(errno)));
    client.sent[rank]++;
    return MELISSA_DL_OK;
}

/* A control message (DECLARE or FINALIZE): a JSON payload, no shape. */
static int send_control(size_t rank, int kind, const strbuf *body) {
    uint8_t header[HEADER_BYTES];
    pack_header(header, kind, 0, 0, DTYPE_UINT8, NULL, 0, body->size, 0);
    return send_message(rank, header, body->data, body->size);
}

/* -- connection ---------------------------------------------------------- */

static void forget_predictions(predictor *p) {
    for (size_t i = 0; i < p->nranks; i++)
        free(p->endpoints ? p->endpoints[i] : NULL);
    for (size_t i = 0; i < p->ninputs; i++)
        free(p->names ? p->names[i] : NULL);
    free(p->endpoints);
    free(p->links);
    free(p->opened);
    free(p->names);
    free(p->dtypes);
    free(p->ndims);
    free(p->shapes);
    free(p->question_bytes);
}

/* Forget the connection and the declarations. */
static void forget(void) {
    for (size_t i = 0; i < client.nfields; i++)
        free(client.fields[i].name);
    free(client.fields);
    free(client.links);
    free(client.asks);
    free(client.sent);
    free(client.steps.slots);
    forget_predictions(&client.predict);
    free_environment(&client.env);
    memset(&client, 0, sizeof client);
}

/* Close the sockets at once, dropping queued frames, and the context; forget everything. */
static void release(void) {
    for (size_t i = 0; i < client.nlinks; i++) {
        mdl_link_close(&client.links[i]);
        mdl_link_close(&client.asks[i].link);
    }
    for (size_t i = 0; i < client.predict.nranks; i++)
        if (client.predict.opened[i])
            mdl_link_close(&client.predict.links[i]);
    if (client.context != NULL)
        while (zmq_ctx_term(client.context) != 0 && errno == EINTR)
            ;
    forget();
}

/* The FINALIZE message announcing to a server rank the distinct steps it was sent. */
static int send_finalize(size_t rank, const size_t *counts) {
    strbuf body = {0};
    sb_printf(&body, "{\"steps\":%zu}", counts[rank]);
    int code = body.failed ? fail(MELISSA_DL_ERR_SYSTEM, "out of memory") : send_control(rank, KIND_FINALIZE, &body);
    free(body.data);
    return code;
}

/* The FINALIZE to a rank sent again if its link reconnected since ``*drops`` (it may be lost with the connection),
 * not counted: it stands for the lost one. */
static int resend_finalize(size_t rank, const size_t *counts, unsigned *drops) {
    mdl_link *link = &client.links[rank];
    if (!link->up || link->drops <= *drops)
        return MELISSA_DL_OK;
    uint64_t sent = client.sent[rank];
    int code = send_finalize(rank, counts);
    client.sent[rank] = sent;
    *drops = link->drops;
    return code;
}

/* Wait until every rank confirms it read every message sent to it (or its simulation ended), for as long as the
 * ranks live; a FINALIZE lost with a broken connection is sent again (not counted: it stands for the lost one). */
static int await_delivery(const size_t *counts) {
    size_t n = client.nlinks, waiting = n;
    bool *done = calloc(n, sizeof *done);
    unsigned *drops = calloc(n, sizeof *drops);
    zmq_pollitem_t *items = calloc(n, sizeof *items);
    int code = done && drops && items ? MELISSA_DL_OK : fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    for (size_t r = 0; code == MELISSA_DL_OK && r < n; r++) {
        mdl_link_update(&client.links[r]);
        drops[r] = client.links[r].drops; /* when the FINALIZE was queued */
        items[r] = (zmq_pollitem_t){client.asks[r].link.socket, 0, ZMQ_POLLIN, 0};
        ask_rank(r, true, 0);
    }
    while (code == MELISSA_DL_OK && waiting > 0) {
        zmq_poll(items, (int)n, ANSWER_POLL_MS);
        for (size_t r = 0; code == MELISSA_DL_OK && r < n; r++) {
            if (done[r])
                continue;
            uint64_t read;
            bool finalized, ended;
            int got = answer(r, &read, &finalized, &ended);
            if (got == 0)
                ask_rank(r, true, 0); /* again, if it was lost */
            if (got <= 0) {
                code = got < 0 ? got : alive(r);
                continue;
            }
            if (ended || (finalized && read >= client.sent[r])) {
                done[r] = true;
                waiting--;
                continue;
            }
            if (finalized) { /* the FINALIZE, sent last, was read: what is missing before it is lost */
                code = fail(MELISSA_DL_ERR_UNREACHABLE, "simulation %u: server rank %zu (%s) read %llu of the %llu "
                            "messages sent to it: %llu lost with a broken connection", client.env.simulation_id, r,
                            client.links[r].endpoint, (unsigned long long)read, (unsigned long long)client.sent[r],
                            (unsigned long long)(client.sent[r] - read));
                continue;
            }
            code = resend_finalize(r, counts, &drops[r]);
            ask_rank(r, true, 0);
        }
    }
    free(done);
    free(drops);
    free(items);
    return code;
}

/* A random 64-bit number, for the hello's nonce: the server tells a hello sent again from another process's. */
static uint64_t nonce(void) {
    uint64_t value = 0;
    if (getrandom(&value, sizeof value, GRND_NONBLOCK) != (ssize_t)sizeof value)
        value = ((uint64_t)getpid() << 32) ^ (uint64_t)(mdl_now() * 1e9); /* no entropy yet: still this process's */
    return value;
}

/* The handshake's JSON request. */
static bool hello(strbuf *sb) {
    sb_printf(sb, "{\"protocol\":%d,\"token\":", MELISSA_DL_PROTOCOL_VERSION);
    sb_json_string(sb, client.env.token);
    sb_printf(sb, ",\"simulation_id\":%u,\"attempt\":%u,\"client_rank\":%d,\"client_size\":%d,\"fields\":",
              client.env.simulation_id, client.env.attempt, client.rank, client.size);
    sb_fields(sb);
    sb_printf(sb, ",\"nonce\":\"%016llx\"}", (unsigned long long)nonce());
    return !sb->failed;
}

/* A REQ link to rank 0's handshake service, on which a request may be sent again (REQ_RELAXED; REQ_CORRELATE:
 * only the answer to the latest one is taken). */
static int open_handshake(mdl_link *link, void *context, const environment *env) {
    int one = 1;
    if (mdl_link_open(link, context, ZMQ_REQ, env->endpoint, &env->security, 0) != 0)
        return fail(errno == ENOMEM ? MELISSA_DL_ERR_SYSTEM : MELISSA_DL_ERR_ENVIRONMENT, "MELISSA_SERVER='%s': %s",
                    env->endpoint, zmq_strerror(errno));
    if (zmq_setsockopt(link->socket, ZMQ_REQ_RELAXED, &one, sizeof one) != 0 ||
        zmq_setsockopt(link->socket, ZMQ_REQ_CORRELATE, &one, sizeof one) != 0) {
        int code = fail(MELISSA_DL_ERR_SYSTEM, "handshake with %s: %s", env->endpoint, zmq_strerror(errno));
        mdl_link_close(link);
        return code;
    }
    return MELISSA_DL_OK;
}

/* Send ``request`` to the handshake service on ``link`` and take its accepting answer, a JSON object, into
 * *reply (to free); the request is sent again whenever the connection that carried it, or its answer, is lost.
 * MELISSA_DL_ERR_REFUSED if the service refuses it (``who`` names the asker: "simulation 3", "worker 0:1"),
 * MELISSA_DL_ERR_UNREACHABLE without an answer for the timeout. Never a blocking send: a server that refuses
 * the credentials in the ZeroMQ handshake leaves the socket without a connection, where a send would wait for
 * ever, and that refusal can come before the first send (on a busy machine); a send that finds no connection
 * is tried again after the monitor's next event. */
static int ask(mdl_link *link, const environment *env, const char *who, const strbuf *request, json_value *reply) {
    *reply = (json_value){0};
    int code = MELISSA_DL_OK;
    zmq_msg_t message;
    zmq_msg_init(&message);
    double deadline = mdl_now() + env->timeout;
    unsigned drops = link->drops;
    bool sent = false;
    for (;;) {
        mdl_link_update(link);
        if (link->refused) {
            code = refused(link, who, env);
            break;
        }
        if (link->drops > drops || !sent) { /* not queued yet, or the connection that carried it was lost */
            drops = link->drops;
            sent = zmq_send(link->socket, request->data, request->size, ZMQ_DONTWAIT) >= 0;
            if (!sent && errno != EAGAIN) {
                code = fail(MELISSA_DL_ERR_SYSTEM, "handshake with %s: %s", env->endpoint, zmq_strerror(errno));
                break;
            }
        }
        double left = deadline - mdl_now();
        if (left <= 0) {
            code = link->failed_handshakes
                       ? fail(MELISSA_DL_ERR_UNREACHABLE, "no handshake answer from %s within %g s (%u ZeroMQ "
                              "handshakes with it failed: another security level or CURVE server key than "
                              "MELISSA_SECURITY=%s?)", env->endpoint, env->timeout, link->failed_handshakes,
                              mdl_security_name(env->security.level))
                       : fail(MELISSA_DL_ERR_UNREACHABLE, "no handshake answer from %s within %g s", env->endpoint,
                              env->timeout);
            break;
        }
        zmq_pollitem_t items[2] = {{link->socket, 0, ZMQ_POLLIN, 0}, {link->monitor, 0, ZMQ_POLLIN, 0}};
        int ready = zmq_poll(items, 2, (long)(left * 1000) + 1);
        if (ready < 0 && errno != EINTR) {
            code = fail(MELISSA_DL_ERR_SYSTEM, "handshake with %s: %s", env->endpoint, zmq_strerror(errno));
            break;
        }
        if (ready > 0 && (items[0].revents & ZMQ_POLLIN)) {
            if (zmq_msg_recv(&message, link->socket, 0) < 0)
                code = fail(MELISSA_DL_ERR_SYSTEM, "handshake with %s: %s", env->endpoint, zmq_strerror(errno));
            else if (!mdl_json_parse(zmq_msg_data(&message), zmq_msg_size(&message), reply) ||
                     reply->type != JSON_OBJECT)
                code = fail(MELISSA_DL_ERR_PROTOCOL, "the handshake answer of %s is not a JSON object", env->endpoint);
            break;
        }
    }
    zmq_msg_close(&message);
    if (code == MELISSA_DL_OK) {
        const json_value *ok = mdl_json_get(reply, "ok"), *error = mdl_json_get(reply, "error");
        if (ok == NULL || ok->type != JSON_BOOL || !ok->boolean)
            code = fail(MELISSA_DL_ERR_REFUSED, "%s: %s", who,
                        error && error->type == JSON_STRING ? error->string : "refused without a reason");
    }
    if (code != MELISSA_DL_OK)
        mdl_json_free(reply);
    return code;
}

/* The prediction dtypes (melissa_dl.config.limits.DTYPES) and their sizes. */
static const char *const PREDICT_DTYPES[] = {"float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8"};
static const size_t PREDICT_BYTES[] = {4, 8, 2, 1, 2, 4, 8, 1};
enum { NPREDICT_DTYPES = 8 };

static int predict_dtype(const json_value *name) {
    for (int i = 0; name->type == JSON_STRING && i < NPREDICT_DTYPES; i++)
        if (strcmp(name->string, PREDICT_DTYPES[i]) == 0)
            return i;
    return -1;
}

/* Take the handshake answer's "predictions": each rank's service, the model's inputs, the limits; false if they
 * are malformed or memory ran out. */
static bool accept_predictions(const json_value *guide) {
    predictor *p = &client.predict;
    const json_value *endpoints = mdl_json_get(guide, "endpoints"), *inputs = mdl_json_get(guide, "inputs");
    const json_value *max_batch = mdl_json_get(guide, "max_batch"), *deadline = mdl_json_get(guide, "deadline");
    if (!endpoints || endpoints->type != JSON_ARRAY || endpoints->size == 0 || !inputs || inputs->type != JSON_OBJECT
        || !max_batch || max_batch->type != JSON_NUMBER || max_batch->number < 1 || !deadline ||
        deadline->type != JSON_NUMBER || deadline->number <= 0)
        return false;
    p->max_batch = (size_t)max_batch->number;
    p->deadline = deadline->number;
    p->endpoints = calloc(endpoints->size, sizeof *p->endpoints);
    p->links = calloc(endpoints->size, sizeof *p->links);
    p->opened = calloc(endpoints->size, sizeof *p->opened);
    size_t n = inputs->size ? inputs->size : 1;
    p->names = calloc(n, sizeof *p->names);
    p->dtypes = calloc(n, sizeof *p->dtypes);
    p->ndims = calloc(n, sizeof *p->ndims);
    p->shapes = calloc(n, sizeof *p->shapes);
    p->question_bytes = calloc(n, sizeof *p->question_bytes);
    if (!p->endpoints || !p->links || !p->opened || !p->names || !p->dtypes || !p->ndims || !p->shapes ||
        !p->question_bytes)
        return false;
    for (; p->nranks < endpoints->size; p->nranks++) {
        const json_value *endpoint = &endpoints->items[p->nranks];
        if (endpoint->type != JSON_STRING || (p->endpoints[p->nranks] = strdup(endpoint->string)) == NULL)
            return false;
    }
    for (; p->ninputs < inputs->size; p->ninputs++) {
        size_t i = p->ninputs;
        const json_value *layout = &inputs->items[i];
        if (layout->type != JSON_ARRAY || layout->size != 2 || (p->dtypes[i] = predict_dtype(&layout->items[0])) < 0
            || layout->items[1].type != JSON_ARRAY || layout->items[1].size >= MAX_NDIM ||
            (p->names[i] = strdup(inputs->keys[i])) == NULL)
            return false;
        p->ndims[i] = (int)layout->items[1].size;
        p->question_bytes[i] = PREDICT_BYTES[p->dtypes[i]];
        for (int d = 0; d < p->ndims[i]; d++) {
            const json_value *size = &layout->items[1].items[d];
            if (size->type != JSON_NUMBER || size->number < 1 || size->number > UINT32_MAX)
                return false;
            p->shapes[i][d] = (size_t)size->number;
            p->question_bytes[i] *= p->shapes[i][d];
        }
    }
    return true;
}

/* Check an accepting reply and take the routing from it. */
static int accept_reply(const json_value *reply) {
    const json_value *endpoints = mdl_json_get(reply, "endpoints");
    const json_value *acks = mdl_json_get(reply, "acks");
    const json_value *fields = mdl_json_get(reply, "fields");
    const json_value *bind = mdl_json_get(reply, "bind_simulation");
    const json_value *block = mdl_json_get(reply, "block");
    const json_value *overlap = mdl_json_get(reply, "overlap");
    bool ok = endpoints && acks && fields && bind && endpoints->type == JSON_ARRAY && endpoints->size > 0 &&
              acks->type == JSON_ARRAY && acks->size == endpoints->size && fields->type == JSON_ARRAY &&
              bind->type == JSON_BOOL && block && block->type == JSON_NUMBER && block->number >= 1 &&
              block->number <= UINT32_MAX && overlap && overlap->type == JSON_NUMBER && overlap->number >= 0 &&
              overlap->number <= block->number;
    for (size_t i = 0; ok && i < endpoints->size; i++)
        ok = endpoints->items[i].type == JSON_STRING && acks->items[i].type == JSON_STRING;
    for (size_t f = 0; ok && f < client.nfields; f++) {
        ok = false;
        for (size_t i = 0; i < fields->size && i <= UINT16_MAX; i++)
            if (fields->items[i].type == JSON_STRING && strcmp(fields->items[i].string, client.fields[f].name) == 0) {
                client.fields[f].id = (uint16_t)i;
                ok = true;
            }
    }
    if (!ok)
        return fail(MELISSA_DL_ERR_PROTOCOL, "simulation %u: the handshake answer lacks endpoints, fields or routing",
                    client.env.simulation_id);
    const json_value *predictions = mdl_json_get(reply, "predictions");
    if (predictions != NULL && predictions->type == JSON_OBJECT && !accept_predictions(predictions))
        return fail(MELISSA_DL_ERR_PROTOCOL, "simulation %u: the handshake answer's predictions are malformed (or "
                    "memory ran out)", client.env.simulation_id);
    client.bind_simulation = bind->boolean;
    client.block = (uint64_t)block->number;
    client.overlap = (uint64_t)overlap->number;
    client.links = calloc(endpoints->size, sizeof *client.links);
    client.asks = calloc(endpoints->size, sizeof *client.asks);
    client.sent = calloc(endpoints->size, sizeof *client.sent);
    if (client.links == NULL || client.asks == NULL || client.sent == NULL)
        return fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    double largest = 1;
    for (size_t f = 0; f < client.nfields; f++)
        largest = fmax(largest, (double)client.fields[f].count * (double)ITEM_BYTES[client.fields[f].dtype]);
    int hwm = (int)fmin(fmax(2, floor(client.env.queue_bytes / largest)), INT32_MAX);
    for (size_t i = 0; i < endpoints->size; i++) {
        if (mdl_link_open(&client.links[i], client.context, ZMQ_PUSH, endpoints->items[i].string,
                          &client.env.security, hwm) != 0)
            return fail(MELISSA_DL_ERR_PROTOCOL, "simulation %u: cannot connect to the data endpoint '%s': %s",
                        client.env.simulation_id, endpoints->items[i].string, zmq_strerror(errno));
        if (mdl_link_open(&client.asks[i].link, client.context, ZMQ_DEALER, acks->items[i].string,
                          &client.env.security, 0) != 0) {
            mdl_link_close(&client.links[i]);
            return fail(MELISSA_DL_ERR_PROTOCOL, "simulation %u: cannot connect to the delivery endpoint '%s': %s",
                        client.env.simulation_id, acks->items[i].string, zmq_strerror(errno));
        }
        client.asks[i].last_asked = mdl_now();
        client.nlinks++;
    }
    return MELISSA_DL_OK;
}

/* Handshake, connect to every server rank and declare the fields there. */
static int handshake(void) {
    json_value reply = {0};
    strbuf request = {0};
    mdl_link link = {0};
    client.context = zmq_ctx_new();
    int code = client.context ? MELISSA_DL_OK : fail(MELISSA_DL_ERR_SYSTEM, "zmq_ctx_new: %s", zmq_strerror(errno));
    if (code == MELISSA_DL_OK && !hello(&request))
        code = fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    if (code == MELISSA_DL_OK)
        code = open_handshake(&link, client.context, &client.env);
    if (code == MELISSA_DL_OK)
        code = ask(&link, &client.env, simulation_name(), &request, &reply);
    mdl_link_close(&link);
    free(request.data);
    if (code == MELISSA_DL_OK)
        code = accept_reply(&reply);
    mdl_json_free(&reply);
    if (code == MELISSA_DL_OK) {
        client.phase = CONNECTED;
        strbuf declaration = {0};
        sb_printf(&declaration, "{\"fields\":");
        sb_fields(&declaration);
        sb_printf(&declaration, "}");
        code = declaration.failed ? fail(MELISSA_DL_ERR_SYSTEM, "out of memory") : MELISSA_DL_OK;
        for (size_t i = 0; code == MELISSA_DL_OK && i < client.nlinks; i++)
            code = send_control(i, KIND_DECLARE, &declaration);
        free(declaration.data);
    }
    return code == MELISSA_DL_OK ? code : broken(code);
}

/* -- the API ------------------------------------------------------------- */

const char *melissa_dl_version(int *protocol_version) {
    if (protocol_version != NULL)
        *protocol_version = MELISSA_DL_PROTOCOL_VERSION;
    return MELISSA_DL_VERSION;
}

int melissa_dl_simulation(int *simulation_id, int *attempt) {
    double id, number;
    int code = simulation_ids(&id, &number);
    if (code != MELISSA_DL_OK)
        return code;
    if (simulation_id != NULL)
        *simulation_id = (int)id;
    if (attempt != NULL)
        *attempt = (int)number;
    return MELISSA_DL_OK;
}

/* The variable ``name``, a JSON list of ``type`` items (``what``: "numbers"), in *list;
 * *list is empty, to free or not, on failure. */
static int env_list(const char *name, json_type type, const char *what, json_value *list) {
    const char *text;
    *list = (json_value){0};
    int code = require(name, &text);
    if (code != MELISSA_DL_OK)
        return code;
    bool ok = mdl_json_parse(text, strlen(text), list) && list->type == JSON_ARRAY && list->size <= INT32_MAX;
    for (size_t i = 0; ok && i < list->size; i++)
        ok = list->items[i].type == type;
    if (!ok) {
        mdl_json_free(list);
        return fail(MELISSA_DL_ERR_ENVIRONMENT, "%s='%s' is not a JSON list of %s", name, text, what);
    }
    return MELISSA_DL_OK;
}

int melissa_dl_parameters(double *values, int capacity, int *count) {
    const char *text;
    int code = require("MELISSA_PARAMETERS", &text);
    if (code != MELISSA_DL_OK)
        return code;
    if (count == NULL)
        return fail(MELISSA_DL_ERR_ARGUMENT, "melissa_dl_parameters: count is NULL");
    json_value list;
    code = env_list("MELISSA_PARAMETERS", JSON_NUMBER, "numbers", &list);
    if (code != MELISSA_DL_OK)
        return code;
    *count = (int)list.size;
    if (values != NULL && capacity < *count)
        code = fail(MELISSA_DL_ERR_ARGUMENT, "melissa_dl_parameters: %d parameters, room for %d", *count, capacity);
    for (int i = 0; code == MELISSA_DL_OK && values != NULL && i < *count; i++)
        values[i] = list.items[i].number;
    mdl_json_free(&list);
    return code;
}

int melissa_dl_parameter(const char *name, double *value) {
    if (name == NULL || value == NULL)
        return fail(MELISSA_DL_ERR_ARGUMENT, "melissa_dl_parameter: %s is NULL", name == NULL ? "name" : "value");
    if (getenv("MELISSA_PARAMETER_NAMES") == NULL)
        return fail(MELISSA_DL_ERR_ENVIRONMENT, "MELISSA_PARAMETER_NAMES is not set: start this simulation through "
                    "melissa-server's launcher (an older one passes the parameters without their names: read them "
                    "by position with melissa_dl_parameters)");
    json_value names, values;
    int code = env_list("MELISSA_PARAMETER_NAMES", JSON_STRING, "strings", &names);
    if (code == MELISSA_DL_OK)
        code = env_list("MELISSA_PARAMETERS", JSON_NUMBER, "numbers", &values);
    if (code != MELISSA_DL_OK) {
        mdl_json_free(&names);
        return code;
    }
    if (names.size != values.size)
        code = fail(MELISSA_DL_ERR_ENVIRONMENT, "MELISSA_PARAMETER_NAMES='%s' and MELISSA_PARAMETERS='%s' differ "
                    "in length (%zu and %zu)", getenv("MELISSA_PARAMETER_NAMES"), getenv("MELISSA_PARAMETERS"),
                    names.size, values.size);
    size_t i = 0;
    while (code == MELISSA_DL_OK && i < names.size && strcmp(names.items[i].string, name) != 0)
        i++;
    if (code == MELISSA_DL_OK && i < names.size) {
        *value = values.items[i].number;
    } else if (code == MELISSA_DL_OK) {
        strbuf known = {0};
        for (size_t j = 0; j < names.size; j++)
            sb_printf(&known, "%s%s", j ? ", " : "", names.items[j].string);
        if (names.size == 0)
            fail(MELISSA_DL_ERR_ARGUMENT, "melissa_dl_parameter: no parameter '%s' (the study has none)", name);
        else
            fail(MELISSA_DL_ERR_ARGUMENT, "melissa_dl_parameter: no parameter '%s' (the study's: %s)", name,
                 known.failed ? "?" : known.data);
        free(known.data);
        code = MELISSA_DL_ERR_ARGUMENT;
    }
    mdl_json_free(&names);
    mdl_json_free(&values);
    return code;
}

/* Weak: the library needs no MPI library of its own (it is linked --as-needed), so a serial program that
 * passes MPI_COMM_NULL and links no MPI loads none. Debian's MPICH and the libraries it pulls in (hwloc,
 * UCX, ...) took 2 ms of each start to load (5.2 against 3.1 ms for the bench's client), which a study of
 * many short simulations pays at every start. An MPI program links its MPI, and these resolve to it. */
#pragma weak MPI_Initialized
#pragma weak MPI_Comm_rank
#pragma weak MPI_Comm_size
#pragma weak MPI_Ibarrier
#pragma weak MPI_Test
#pragma weak MPI_Bcast

/* This process's rank and size in ``comm``: 0 of 1 for MPI_COMM_NULL (a serial program, which need not pay
 * MPI_Init). ``who`` begins the errors ("field 'x'"). */
static int communicator(MPI_Comm comm, const char *who, int *rank, int *size) {
    int initialized;
    *rank = 0;
    *size = 1;
    if (comm == MPI_COMM_NULL)
        return MELISSA_DL_OK;
    if (MPI_Initialized == NULL)
        return fail(MELISSA_DL_ERR_MPI, "%s: a communicator was passed, but this program is not linked with MPI "
                    "(build it with mpicc, or pass MPI_COMM_NULL from a serial program)", who);
    if (MPI_Initialized(&initialized) != MPI_SUCCESS || !initialized)
        return fail(MELISSA_DL_ERR_MPI, "%s: MPI is not initialised: call MPI_Init first (or pass MPI_COMM_NULL "
                    "from a serial program)", who);
    if (MPI_Comm_rank(comm, rank) != MPI_SUCCESS || MPI_Comm_size(comm, size) != MPI_SUCCESS)
        return fail(MELISSA_DL_ERR_MPI, "%s: the communicator gives no rank or size", who);
    return MELISSA_DL_OK;
}

/* Declare a field (``block``: its block, with ndim > 0; NULL: a 1-D slice of ``local_count`` elements). */
static int declare(const char *name, int dtype, size_t local_count, const field *block, MPI_Comm comm) {
    if (name == NULL || name[0] == '\0')
        return fail(MELISSA_DL_ERR_ARGUMENT, "melissa_dl_init: the field name is NULL or empty");
    if (dtype != MELISSA_DL_FLOAT32 && dtype != MELISSA_DL_FLOAT64)
        return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': dtype %d is neither MELISSA_DL_FLOAT32 (0) nor "
                    "MELISSA_DL_FLOAT64 (1)", name, dtype);
    if (local_count > UINT32_MAX)
        return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': %zu elements, the protocol allows at most 2^32 - 1",
                    name, local_count);
    if (client.phase == CONNECTED || client.phase == BROKEN)
        return fail(MELISSA_DL_ERR_STATE, "field '%s': declare every field before the first send", name);
    for (size_t i = 0; i < client.nfields; i++)
        if (strcmp(client.fields[i].name, name) == 0)
            return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s' is declared twice", name);
    int rank, size;
    char who[MESSAGE_BYTES];
    snprintf(who, sizeof who, "field '%s'", name);
    int code = communicator(comm, who, &rank, &size);
    if (code != MELISSA_DL_OK)
        return code;
    if (size > UINT16_MAX)
        return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': %d client ranks, the protocol allows at most 65535", name,
                    size);
    if (client.phase == DECLARED && (rank != client.rank || size != client.size))
        return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': its communicator (rank %d of %d) is not the first field's "
                    "(rank %d of %d)", name, rank, size, client.rank, client.size);
    field *fields = realloc(client.fields, (client.nfields + 1) * sizeof *fields);
    char *copy = strdup(name);
    if (fields != NULL)
        client.fields = fields;
    if (fields == NULL || copy == NULL) {
        free(copy);
        return fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    }
    if (client.phase == EMPTY) {
        code = read_environment(&client.env);
        if (code != MELISSA_DL_OK) {
            free(copy);
            return code;
        }
        client.rank = rank;
        client.size = size;
        client.phase = DECLARED;
    }
    field *f = &client.fields[client.nfields++];
    *f = block != NULL ? *block : (field){0};
    f->name = copy;
    f->dtype = dtype;
    f->count = local_count;
    return MELISSA_DL_OK;
}

int melissa_dl_init(const char *name, int dtype, size_t local_count, MPI_Comm comm) {
    return declare(name, dtype, local_count, NULL, comm);
}

int melissa_dl_init_fortran(const char *name, int dtype, int64_t local_count, MPI_Fint comm) {
    if (local_count < 0)
        return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': negative element count %lld", name ? name : "",
                    (long long)local_count);
    return melissa_dl_init(name, dtype, (size_t)local_count, MPI_Comm_f2c(comm));
}

/* A block's dimensions checked (each below 2^32, the block inside the global shape) into ``block``; ``order``:
 * 'C' or 'F'. */
static int block_of(const char *name, int ndim, const int64_t *global, const int64_t *start, const int64_t *shape,
                    char order, field *block, size_t *count) {
    if (ndim < 1 || ndim > MAX_NDIM)
        return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': %d dimensions: a block's global shape, start and shape "
                    "have 1 to %d each, as many", name ? name : "", ndim, MAX_NDIM);
    if (global == NULL || start == NULL || shape == NULL)
        return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': a NULL global shape, start or shape", name ? name : "");
    *block = (field){.ndim = ndim, .order = order};
    *count = 1;
    for (int d = 0; d < ndim; d++) {
        if (global[d] < 0 || start[d] < 0 || shape[d] < 0 || global[d] > UINT32_MAX || start[d] > global[d] ||
            shape[d] > global[d] - start[d])
            return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': axis %d: a block of %lld from %lld does not fit in "
                        "%lld", name ? name : "", d, (long long)shape[d], (long long)start[d], (long long)global[d]);
        block->global[d] = (size_t)global[d];
        block->start[d] = (size_t)start[d];
        block->shape[d] = (size_t)shape[d];
        if (shape[d] && *count > UINT32_MAX / (size_t)shape[d])
            return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': a block of more than 2^32 - 1 elements",
                        name ? name : "");
        *count *= (size_t)shape[d];
    }
    return MELISSA_DL_OK;
}

int melissa_dl_init_block(const char *name, int dtype, int ndim, const size_t *global_shape, const size_t *start,
                          const size_t *shape, MPI_Comm comm) {
    int64_t dims[3][MAX_NDIM];
    const size_t *given[3] = {global_shape, start, shape};
    for (int k = 0; k < 3; k++)
        for (int d = 0; given[k] != NULL && d < ndim && d < MAX_NDIM; d++)
            dims[k][d] = given[k][d] > INT64_MAX ? -1 : (int64_t)given[k][d];
    field block;
    size_t count;
    int code = block_of(name, ndim, global_shape ? dims[0] : NULL, start ? dims[1] : NULL, shape ? dims[2] : NULL,
                        'C', &block, &count);
    return code == MELISSA_DL_OK ? declare(name, dtype, count, &block, comm) : code;
}

int melissa_dl_init_block_fortran(const char *name, int dtype, int ndim, const int64_t *global_shape,
                                  const int64_t *start, const int64_t *shape, MPI_Fint comm) {
    field block;
    size_t count;
    int code = block_of(name, ndim, global_shape, start, shape, 'F', &block, &count);
    return code == MELISSA_DL_OK ? declare(name, dtype, count, &block, MPI_Comm_f2c(comm)) : code;
}

/* -- persistent workers ------------------------------------------------- */

static const double WORKER_POLL = 0.01; /* seconds between two looks of a worker's other ranks at rank 0's answer */
static const double MAX_WAIT = 3600;   /* the longest "wait" the handshake service may ask for */

/* A variable that an answer set, and its value at the worker's start (NULL: unset). */
typedef struct {
    char *name, *value;
} saved_variable;

static struct {
    bool over;             /* the study is over: melissa_dl_next hands no more */
    char last[64];         /* "simulation:attempt" it was last told ("": none yet), so that a question sent again
                              after a lost answer gets that answer again rather than ending the simulation */
    saved_variable *saved; /* restored before each answer applies: a simulation's environment is the worker's with
                              its answer on top (an answer holds what differs from the worker's start) */
    size_t nsaved;
} worker;

static void pause_for(double seconds) {
    struct timespec left = {(time_t)seconds, (long)((seconds - floor(seconds)) * 1e9)};
    while (nanosleep(&left, &left) != 0 && errno == EINTR)
        ;
}

/* An answer's "env" object as "NAME\0VALUE\0..." in *packed (names non-empty and without '=', values strings). */
static int pack_env(const json_value *vars, const char *who, strbuf *packed) {
    for (size_t i = 0; i < vars->size; i++) {
        const char *name = vars->keys[i];
        if (name[0] == '\0' || strchr(name, '=') != NULL || vars->items[i].type != JSON_STRING)
            return fail(MELISSA_DL_ERR_PROTOCOL, "%s: the handshake service handed the variable '%s', which is not "
                        "a name with a string value", who, name);
        sb_printf(packed, "%s%c%s%c", name, '\0', vars->items[i].string, '\0');
    }
    return packed->failed ? fail(MELISSA_DL_ERR_SYSTEM, "out of memory") : MELISSA_DL_OK;
}

/* Rank 0 asks the handshake service for this worker's next simulation (``name``: MELISSA_WORKER), again after
 * each "wait", until it hands one (its variables packed in *packed) or says the study is over (*over). */
static int ask_next(const char *name, strbuf *packed, bool *over) {
    environment env = {0};
    int code = read_server(&env);
    if (code != MELISSA_DL_OK)
        return code;
    char who[128];
    snprintf(who, sizeof who, "worker %.100s", name);
    strbuf request = {0};
    sb_printf(&request, "{\"protocol\":%d,\"token\":", MELISSA_DL_PROTOCOL_VERSION);
    sb_json_string(&request, env.token);
    sb_printf(&request, ",\"worker\":");
    sb_json_string(&request, name);
    sb_printf(&request, ",\"last\":");
    if (worker.last[0] != '\0')
        sb_json_string(&request, worker.last);
    else
        sb_printf(&request, "null");
    sb_printf(&request, "}");
    mdl_link link = {0};
    void *context = request.failed ? NULL : zmq_ctx_new();
    if (request.failed)
        code = fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    else if (context == NULL)
        code = fail(MELISSA_DL_ERR_SYSTEM, "zmq_ctx_new: %s", zmq_strerror(errno));
    else
        code = open_handshake(&link, context, &env);
    while (code == MELISSA_DL_OK) {
        json_value reply;
        code = ask(&link, &env, who, &request, &reply);
        if (code != MELISSA_DL_OK)
            break;
        const json_value *vars = mdl_json_get(&reply, "env"), *wait = mdl_json_get(&reply, "wait"),
                         *done = mdl_json_get(&reply, "over");
        double seconds = wait && wait->type == JSON_NUMBER ? wait->number : -1;
        bool again = !vars && !done && seconds >= 0 && seconds <= MAX_WAIT;
        if (vars && vars->type == JSON_OBJECT)
            code = pack_env(vars, who, packed);
        else if (done && done->type == JSON_BOOL && done->boolean)
            *over = true;
        else if (!again)
            code = fail(MELISSA_DL_ERR_PROTOCOL, "%s: the handshake service answered something else than {env}, "
                        "{wait} or {over}", who);
        mdl_json_free(&reply);
        if (!again)
            break;
        pause_for(seconds);
    }
    mdl_link_close(&link);
    if (context != NULL)
        while (zmq_ctx_term(context) != 0 && errno == EINTR)
            ;
    free(request.data);
    free_environment(&env);
    return code;
}

/* Rank 0's outcome reaches every rank of ``comm``: its code (and message), whether the study is over, and the
 * variables packed. The other ranks wait on a barrier they test every WORKER_POLL seconds, asleep meanwhile, so
 * that an idle worker burns no core. The text goes in pieces of SHARE_BYTES, which a rank out of memory can still
 * take part in (and drop). */
enum { SHARE_BYTES = 1 << 16 };

/* A barrier whose waiting ranks sleep between looks: MPI's own would spin a core while rank 0 waits for the
 * handshake service. */
static int polled_barrier(MPI_Comm comm) {
    MPI_Request arrived;
    int done = 0;
    if (MPI_Ibarrier(comm, &arrived) != MPI_SUCCESS)
        return fail(MELISSA_DL_ERR_MPI, "melissa_dl_next: MPI_Ibarrier failed");
    while (!done) {
        if (MPI_Test(&arrived, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            return fail(MELISSA_DL_ERR_MPI, "melissa_dl_next: MPI_Test failed");
        if (!done)
            pause_for(WORKER_POLL);
    }
    return MELISSA_DL_OK;
}

static int share(MPI_Comm comm, int rank, int code, strbuf *packed, bool *over) {
    static char scratch[SHARE_BYTES];
    const char *text = code == MELISSA_DL_OK ? packed->data : last_message;
    long long shared[3] = {code, *over, code == MELISSA_DL_OK ? (long long)packed->size : (long long)strlen(text) + 1};
    int barrier = polled_barrier(comm);
    if (barrier != MELISSA_DL_OK)
        return barrier;
    if (MPI_Bcast(shared, 3, MPI_LONG_LONG, 0, comm) != MPI_SUCCESS)
        return fail(MELISSA_DL_ERR_MPI, "melissa_dl_next: MPI_Bcast failed");
    size_t size = (size_t)shared[2];
    char *copy = rank != 0 && size > 0 ? malloc(size) : NULL;
    for (size_t at = 0; at < size; at += SHARE_BYTES) {
        int n = (int)(size - at < SHARE_BYTES ? size - at : SHARE_BYTES);
        void *into = rank == 0 ? (void *)(text + at) : copy ? copy + at : scratch;
        if (MPI_Bcast(into, n, MPI_CHAR, 0, comm) != MPI_SUCCESS) {
            free(copy);
            return fail(MELISSA_DL_ERR_MPI, "melissa_dl_next: MPI_Bcast failed");
        }
    }
    if (rank == 0)
        return code;
    if (size > 0 && copy == NULL)
        return fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    *over = shared[1];
    if (shared[0] != MELISSA_DL_OK) {
        snprintf(last_message, sizeof last_message, "%s", copy ? copy : "");
        free(copy);
        return (int)shared[0];
    }
    free(packed->data);
    *packed = (strbuf){.data = copy, .size = size, .capacity = size};
    return MELISSA_DL_OK;
}

/* A simulation's environment: the worker's as it started, with the variables packed on top. */
static int apply(const strbuf *packed) {
    for (size_t i = 0; i < worker.nsaved; i++) {
        saved_variable *v = &worker.saved[i];
        if ((v->value ? setenv(v->name, v->value, 1) : unsetenv(v->name)) != 0)
            return fail(MELISSA_DL_ERR_SYSTEM, "cannot restore %s: %s", v->name, strerror(errno));
    }
    for (size_t at = 0; at < packed->size;) {
        const char *name = packed->data + at, *value = name + strlen(name) + 1;
        at = (size_t)(value - packed->data) + strlen(value) + 1;
        size_t i = 0;
        while (i < worker.nsaved && strcmp(worker.saved[i].name, name) != 0)
            i++;
        if (i == worker.nsaved) { /* first set: keep its value at the start */
            saved_variable *saved = realloc(worker.saved, (worker.nsaved + 1) * sizeof *saved);
            if (saved == NULL)
                return fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
            worker.saved = saved;
            const char *before = getenv(name);
            saved[i] = (saved_variable){strdup(name), before ? strdup(before) : NULL};
            if (saved[i].name == NULL || (before && saved[i].value == NULL)) {
                free(saved[i].name);
                free(saved[i].value);
                return fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
            }
            worker.nsaved++;
        }
        if (setenv(name, value, 1) != 0)
            return fail(MELISSA_DL_ERR_SYSTEM, "cannot set %s: %s", name, strerror(errno));
    }
    return MELISSA_DL_OK;
}

int melissa_dl_next(MPI_Comm comm, int *more) {
    if (more == NULL)
        return fail(MELISSA_DL_ERR_ARGUMENT, "melissa_dl_next: more is NULL");
    *more = 0;
    if (client.phase != EMPTY)
        return fail(MELISSA_DL_ERR_STATE, "melissa_dl_next: simulation %u is declared and not finalized: call "
                    "melissa_dl_finalize first", client.env.simulation_id);
    int rank, size;
    int code = communicator(comm, "melissa_dl_next", &rank, &size);
    if (code != MELISSA_DL_OK || worker.over)
        return code;
    const char *name = getenv("MELISSA_WORKER");
    if (name == NULL) { /* not a persistent worker: the one simulation of the environment */
        worker.over = true;
        *more = 1;
        return MELISSA_DL_OK;
    }
    strbuf packed = {0};
    bool over = false;
    if (comm != MPI_COMM_NULL) /* every rank is done with the last simulation before rank 0's asking ends it */
        code = polled_barrier(comm);
    if (code == MELISSA_DL_OK && rank == 0)
        code = ask_next(name, &packed, &over);
    if (comm != MPI_COMM_NULL)
        code = share(comm, rank, code, &packed, &over);
    if (code == MELISSA_DL_OK && !over)
        code = apply(&packed);
    free(packed.data);
    if (code != MELISSA_DL_OK)
        return code;
    worker.over = over;
    *more = !over;
    if (!over) {
        const char *id = getenv("MELISSA_SIMULATION_ID"), *attempt = getenv("MELISSA_ATTEMPT");
        snprintf(worker.last, sizeof worker.last, "%.30s:%.30s", id ? id : "", attempt ? attempt : "0");
    }
    return MELISSA_DL_OK;
}

int melissa_dl_next_fortran(MPI_Fint comm, int *more) {
    return melissa_dl_next(MPI_Comm_f2c(comm), more);
}

static int send_field(const char *name, int64_t time_step, const void *data, size_t count, int dtype) {
    if (name == NULL)
        return fail(MELISSA_DL_ERR_ARGUMENT, "send: the field name is NULL");
    if (client.phase == EMPTY)
        return fail(MELISSA_DL_ERR_STATE, "field '%s': no field is declared: call melissa_dl_init first", name);
    if (client.phase == BROKEN)
        return fail(MELISSA_DL_ERR_STATE, "field '%s': the connection failed earlier (%s): call melissa_dl_finalize",
                    name, client.broken);
    field *f = NULL;
    for (size_t i = 0; i < client.nfields; i++)
        if (strcmp(client.fields[i].name, name) == 0)
            f = &client.fields[i];
    if (f == NULL) {
        strbuf declared = {0};
        for (size_t i = 0; i < client.nfields; i++)
            sb_printf(&declared, "%s'%s'", i ? ", " : "", client.fields[i].name);
        fail(MELISSA_DL_ERR_UNDECLARED, "field '%s' was not declared (declared: %s)", name,
             declared.failed ? "?" : declared.data);
        free(declared.data);
        return MELISSA_DL_ERR_UNDECLARED;
    }
    if (time_step < 0 || time_step > UINT32_MAX)
        return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': time step %lld is not in [0, 2^32)", name,
                    (long long)time_step);
    if (dtype != f->dtype)
        return fail(MELISSA_DL_ERR_DTYPE, "field '%s': got %s data, declared %s", name, DTYPE_NAMES[dtype],
                    DTYPE_NAMES[f->dtype]);
    if (count != f->count)
        return fail(MELISSA_DL_ERR_COUNT, "field '%s': got %zu elements, declared %zu", name, count, f->count);
    if (data == NULL && count > 0)
        return fail(MELISSA_DL_ERR_ARGUMENT, "field '%s': the data pointer is NULL", name);
    if (client.phase == DECLARED) {
        int code = handshake();
        if (code != MELISSA_DL_OK)
            return code;
    }
    uint32_t step = (uint32_t)time_step;
    size_t bytes = count * ITEM_BYTES[dtype];
    uint8_t header[HEADER_BYTES];
    int code = MELISSA_DL_OK;
    size_t offset = 0;
    do { /* one message per part; an empty slice is one message too */
        size_t size = bytes - offset < PART_BYTES ? bytes - offset : PART_BYTES;
        if (f->ndim)
            pack_header(header, KIND_DATA, step, f->id, dtype, f->shape, f->ndim, bytes, offset);
        else
            pack_header(header, KIND_DATA, step, f->id, dtype, &count, 1, bytes, offset);
        size_t ranks[2];
        int n = step_ranks(step, ranks);
        for (int i = 0; code == MELISSA_DL_OK && i < n; i++)
            code = send_message(ranks[i], header, bytes ? (const char *)data + offset : data, size);
        offset += size;
    } while (code == MELISSA_DL_OK && offset < bytes);
    if (code == MELISSA_DL_OK && !steps_add(&client.steps, step))
        code = fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    return code;
}

int melissa_dl_send_float(const char *name, int64_t time_step, const float *data, size_t count) {
    return send_field(name, time_step, data, count, MELISSA_DL_FLOAT32);
}

int melissa_dl_send_double(const char *name, int64_t time_step, const double *data, size_t count) {
    return send_field(name, time_step, data, count, MELISSA_DL_FLOAT64);
}

int melissa_dl_send_fortran(const char *name, int64_t time_step, const void *data, int64_t count, int dtype) {
    if (dtype != MELISSA_DL_FLOAT32 && dtype != MELISSA_DL_FLOAT64)
        return fail(MELISSA_DL_ERR_ARGUMENT, "send: dtype %d is neither MELISSA_DL_FLOAT32 (0) nor MELISSA_DL_FLOAT64 (1)",
                    dtype);
    return send_field(name, time_step, data, (size_t)count, dtype);
}

int melissa_dl_finalize(void) {
    if (client.phase == EMPTY)
        return fail(MELISSA_DL_ERR_STATE, "nothing to finalize: no field is declared");
    if (client.phase == BROKEN) {
        fail(MELISSA_DL_ERR_STATE, "nothing announced: the connection failed earlier (%s)", client.broken);
        release();
        return MELISSA_DL_ERR_STATE;
    }
    int code = client.phase == DECLARED ? handshake() : MELISSA_DL_OK;
    size_t *counts = calloc(client.nlinks ? client.nlinks : 1, sizeof *counts);
    if (code == MELISSA_DL_OK && counts == NULL)
        code = fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    for (size_t i = 0; code == MELISSA_DL_OK && i < client.steps.capacity; i++)
        if (client.steps.slots[i] != EMPTY_SLOT) {
            size_t ranks[2];
            int n = step_ranks((uint32_t)client.steps.slots[i], ranks);
            for (int r = 0; r < n; r++)
                counts[ranks[r]]++;
        }
    for (size_t r = 0; code == MELISSA_DL_OK && r < client.nlinks; r++)
        code = send_finalize(r, counts);
    if (code == MELISSA_DL_OK)
        code = await_delivery(counts);
    free(counts);
    release();
    return code;
}

/* -- predictions --------------------------------------------------------- */

/* The request frame (melissa_dl/wire/predictions.py): a little-endian u32 header length, the JSON header, then
 * each input's n questions; NULL if memory ran out. */
static char *prediction_request(size_t n, const void *const *inputs, size_t *size) {
    const predictor *p = &client.predict;
    strbuf header = {0};
    sb_printf(&header, "{\"id\":%llu,\"arrays\":[", (unsigned long long)p->asked);
    size_t data = 0;
    for (size_t i = 0; i < p->ninputs; i++) {
        sb_printf(&header, "%s[", i ? "," : "");
        sb_json_string(&header, p->names[i]);
        sb_printf(&header, ",\"%s\",[%zu", PREDICT_DTYPES[p->dtypes[i]], n);
        for (int d = 0; d < p->ndims[i]; d++)
            sb_printf(&header, ",%zu", p->shapes[i][d]);
        sb_printf(&header, "]]");
        data += n * p->question_bytes[i];
    }
    sb_printf(&header, "]}");
    char *frame = header.failed ? NULL : malloc(4 + header.size + data);
    if (frame != NULL) {
        put((uint8_t *)frame, header.size, 4);
        memcpy(frame + 4, header.data, header.size);
        char *at = frame + 4 + header.size;
        for (size_t i = 0; i < p->ninputs; i++) {
            memcpy(at, inputs[i], n * p->question_bytes[i]);
            at += n * p->question_bytes[i];
        }
        *size = 4 + header.size + data;
    }
    free(header.data);
    return frame;
}

/* Whether float input ``i``'s ``n`` questions are all finite (a NaN is refused here, as by the server). */
static bool finite_input(size_t i, size_t n, const void *data) {
    const predictor *p = &client.predict;
    size_t count = n * p->question_bytes[i] / PREDICT_BYTES[p->dtypes[i]];
    for (size_t k = 0; p->dtypes[i] == 0 && k < count; k++)
        if (!isfinite(((const float *)data)[k]))
            return false;
    for (size_t k = 0; p->dtypes[i] == 1 && k < count; k++)
        if (!isfinite(((const double *)data)[k]))
            return false;
    return true;
}

/* Copy an answer's arrays into the caller's buffers, each of exactly its size. */
static int take_outputs(const json_value *arrays, const char *data, size_t size, int noutputs, void *const *outputs,
                        const size_t *output_bytes) {
    if (arrays->size != (size_t)noutputs)
        return fail(MELISSA_DL_ERR_ARGUMENT, "%s: predict: the model answers %zu outputs, %d buffers were given",
                    simulation_name(), arrays->size, noutputs);
    size_t offset = 0;
    for (size_t j = 0; j < arrays->size; j++) {
        const json_value *array = &arrays->items[j];
        int dtype = array->type == JSON_ARRAY && array->size == 3 ? predict_dtype(&array->items[1]) : -1;
        if (dtype < 0 || array->items[0].type != JSON_STRING || array->items[2].type != JSON_ARRAY)
            return fail(MELISSA_DL_ERR_PROTOCOL, "%s: predict: a malformed answer", simulation_name());
        size_t bytes = PREDICT_BYTES[dtype];
        for (size_t d = 0; d < array->items[2].size; d++)
            bytes *= (size_t)array->items[2].items[d].number;
        if (offset + bytes > size)
            return fail(MELISSA_DL_ERR_PROTOCOL, "%s: predict: an answer shorter than its arrays", simulation_name());
        if (bytes != output_bytes[j] || (bytes && outputs[j] == NULL))
            return fail(MELISSA_DL_ERR_ARGUMENT, "%s: predict: output '%s' is %s of %zu bytes, its buffer %zu bytes",
                        simulation_name(), array->items[0].string, PREDICT_DTYPES[dtype], bytes, output_bytes[j]);
        memcpy(outputs[j], data + offset, bytes);
        offset += bytes;
    }
    return MELISSA_DL_OK;
}

/* Wait until ``until`` for the answer to the request just sent on ``link``; answers to requests given up on are
 * dropped. */
static int prediction_answer(mdl_link *link, size_t rank, double until, int noutputs, void *const *outputs,
                             const size_t *output_bytes, int *status, int64_t *version) {
    *status = MELISSA_DL_NO_ANSWER;
    zmq_msg_t message;
    zmq_msg_init(&message);
    int code = MELISSA_DL_OK;
    double left;
    while (code == MELISSA_DL_OK && *status == MELISSA_DL_NO_ANSWER && (left = until - mdl_now()) > 0) {
        mdl_link_update(link);
        if (link->refused) {
            code = refused(link, simulation_name(), &client.env);
            break;
        }
        zmq_pollitem_t item = {link->socket, 0, ZMQ_POLLIN, 0};
        long wait = (long)(left * 1000) + 1;
        if (zmq_poll(&item, 1, wait < ANSWER_POLL_MS ? wait : ANSWER_POLL_MS) <= 0 ||
            zmq_msg_recv(&message, link->socket, 0) < 0)
            continue;
        const char *frame = zmq_msg_data(&message);
        const uint8_t *bytes = (const uint8_t *)frame;
        size_t size = zmq_msg_size(&message);
        size_t length = size < 4 ? SIZE_MAX
                                 : (size_t)bytes[0] | (size_t)bytes[1] << 8 | (size_t)bytes[2] << 16 | (size_t)bytes[3] << 24;
        json_value header = {0};
        if (size < 4 || length > size - 4 || !mdl_json_parse(frame + 4, length, &header) || header.type != JSON_OBJECT) {
            mdl_json_free(&header);
            code = fail(MELISSA_DL_ERR_PROTOCOL, "%s: predict: server rank %zu's answer is malformed",
                        simulation_name(), rank);
            break;
        }
        const json_value *id = mdl_json_get(&header, "id"), *said = mdl_json_get(&header, "status");
        const json_value *arrays = mdl_json_get(&header, "arrays"), *error = mdl_json_get(&header, "error");
        const json_value *trained = mdl_json_get(&header, "version");
        if (id && id->type == JSON_NUMBER && (uint64_t)id->number == client.predict.asked && said &&
            said->type == JSON_STRING) {
            if (strcmp(said->string, "refused") == 0)
                code = fail(MELISSA_DL_ERR_REFUSED, "%s: server rank %zu: %s", simulation_name(), rank,
                            error && error->type == JSON_STRING ? error->string : "refused without a reason");
            else if (strcmp(said->string, "no_model") == 0)
                *status = MELISSA_DL_NO_MODEL;
            else if (strcmp(said->string, "answered") == 0 && arrays && arrays->type == JSON_ARRAY && trained &&
                     trained->type == JSON_NUMBER) {
                code = take_outputs(arrays, frame + 4 + length, size - 4 - length, noutputs, outputs, output_bytes);
                *status = code == MELISSA_DL_OK ? MELISSA_DL_ANSWERED : MELISSA_DL_NO_ANSWER;
                if (version != NULL)
                    *version = (int64_t)trained->number;
            } else
                code = fail(MELISSA_DL_ERR_PROTOCOL, "%s: predict: server rank %zu's answer is malformed",
                            simulation_name(), rank);
        }
        mdl_json_free(&header);
    }
    zmq_msg_close(&message);
    return code;
}

/* MELISSA_SERVING, the serving.json that melissa-server --serve writes: a program that is no simulation of a study
 * asks the study's final model with it, without a handshake (melissa_dl.Predictor in Python). */
static int open_serving(const char *path) {
    FILE *file = fopen(path, "rb");
    if (file == NULL)
        return fail(MELISSA_DL_ERR_ENVIRONMENT, "MELISSA_SERVING=%s: %s (is melissa-server --serve running?)", path,
                    strerror(errno));
    strbuf text = {0};
    char chunk[4096];
    size_t got;
    while ((got = fread(chunk, 1, sizeof chunk, file)) > 0)
        sb_printf(&text, "%.*s", (int)got, chunk);
    fclose(file);
    json_value published = {0};
    bool ok = !text.failed && text.data && mdl_json_parse(text.data, text.size, &published) &&
              published.type == JSON_OBJECT;
    free(text.data);
    const json_value *credentials = ok ? mdl_json_get(&published, "credentials") : NULL;
    const char *names[5] = {"level", "token", "server_public", "client_public", "client_secret"};
    const json_value *values[5] = {0};
    for (int i = 0; i < 5; i++) {
        values[i] = credentials && credentials->type == JSON_OBJECT ? mdl_json_get(credentials, names[i]) : NULL;
        ok = ok && values[i] && values[i]->type == JSON_STRING;
    }
    client.served = true;
    client.env.simulation_id = (uint32_t)getpid(); /* where its questions start: predictors spread over the ranks */
    if (ok) {
        client.env.security.level = strcmp(values[0]->string, "curve") == 0 ? SECURITY_CURVE : SECURITY_TOKEN;
        client.env.token = strdup(values[1]->string);
        for (int i = 0; i < 3; i++)
            client.env.curve[i] = strdup(values[2 + i]->string);
        client.env.security.token = client.env.token;
        for (int i = 0; i < 3; i++)
            client.env.security.curve[i] = client.env.curve[i];
        client.context = zmq_ctx_new();
        ok = client.env.token && client.context && accept_predictions(&published);
    }
    mdl_json_free(&published);
    if (!ok) {
        release();
        return fail(MELISSA_DL_ERR_ENVIRONMENT, "MELISSA_SERVING=%s: not what melissa-server --serve publishes", path);
    }
    client.phase = CONNECTED;
    return MELISSA_DL_OK;
}

int melissa_dl_predict(size_t n, const void *const *inputs, int noutputs, void *const *outputs,
                       const size_t *output_bytes, double deadline, int *status, int64_t *version) {
    if (status == NULL || (n > 0 && inputs == NULL) || (noutputs > 0 && (outputs == NULL || output_bytes == NULL)))
        return fail(MELISSA_DL_ERR_ARGUMENT, "melissa_dl_predict: status, inputs, outputs or output_bytes is NULL");
    *status = MELISSA_DL_NO_ANSWER;
    if (client.phase == EMPTY && getenv("MELISSA_SERVING") != NULL) {
        int code = open_serving(getenv("MELISSA_SERVING"));
        if (code != MELISSA_DL_OK)
            return code;
    }
    if (client.phase == EMPTY || client.phase == BROKEN)
        return fail(MELISSA_DL_ERR_STATE, "melissa_dl_predict: %s", client.phase == EMPTY ?
                    "no field is declared: call melissa_dl_init first" : "the connection failed earlier");
    if (client.phase == DECLARED) {
        int code = handshake();
        if (code != MELISSA_DL_OK)
            return code;
    }
    predictor *p = &client.predict;
    if (p->nranks == 0)
        return fail(MELISSA_DL_ERR_STATE, "%s: predict: the server answers no predictions (serving.online is off)",
                    simulation_name());
    if (n < 1 || n > p->max_batch)
        return fail(MELISSA_DL_ERR_ARGUMENT, "%s: predict: %zu questions, a request asks 1 to serving.max_batch=%zu",
                    simulation_name(), n, p->max_batch);
    for (size_t i = 0; i < p->ninputs; i++)
        if (inputs[i] == NULL || !finite_input(i, n, inputs[i]))
            return fail(MELISSA_DL_ERR_ARGUMENT, "%s: predict: input '%s' is NULL or holds NaN or infinity",
                        simulation_name(), p->names[i]);
    size_t rank = (client.env.simulation_id + p->asked) % p->nranks;
    if (!p->opened[rank]) {
        if (mdl_link_open(&p->links[rank], client.context, ZMQ_DEALER, p->endpoints[rank], &client.env.security,
                          2) != 0)
            return fail(MELISSA_DL_ERR_SYSTEM, "%s: predict: cannot connect to '%s': %s", simulation_name(),
                        p->endpoints[rank], zmq_strerror(errno));
        p->opened[rank] = true;
    }
    p->asked++;
    size_t size = 0;
    char *frame = prediction_request(n, inputs, &size);
    if (frame == NULL)
        return fail(MELISSA_DL_ERR_SYSTEM, "out of memory");
    bool sent = zmq_send(p->links[rank].socket, frame, size, ZMQ_DONTWAIT) >= 0;
    free(frame);
    if (!sent)
        return MELISSA_DL_OK; /* its rank unreachable, the queue full: no answer */
    double until = mdl_now() + (deadline < 0 ? p->deadline : deadline);
    return prediction_answer(&p->links[rank], rank, until, noutputs, outputs, output_bytes, status, version);
}

const char *melissa_dl_error_message(void) {
    return last_message;
}
