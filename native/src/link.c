/* Client sockets with credentials and a monitor: see link.h and, for the
 * reasons, melissa_dl/wire/client.py and melissa_dl/wire/security.py. */
#define _GNU_SOURCE /* clock_gettime */
#include "link.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

enum {
    EVENTS = ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
             ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL
};

static unsigned monitors; /* numbers the monitors' inproc endpoints (the library is used from one thread) */

double mdl_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

const char *mdl_security_name(int level) {
    return level == SECURITY_CURVE ? "curve" : "token";
}

static int credentials(void *socket, const mdl_security *security) {
    if (security->level == SECURITY_TOKEN) {
        const char *user = "melissa";
        return zmq_setsockopt(socket, ZMQ_PLAIN_USERNAME, user, strlen(user)) ||
               zmq_setsockopt(socket, ZMQ_PLAIN_PASSWORD, security->token, strlen(security->token));
    }
    const int options[3] = {ZMQ_CURVE_SERVERKEY, ZMQ_CURVE_PUBLICKEY, ZMQ_CURVE_SECRETKEY};
    for (int i = 0; i < 3; i++)
        if (zmq_setsockopt(socket, options[i], security->curve[i], strlen(security->curve[i])) != 0)
            return -1;
    return 0;
}

int mdl_link_open(mdl_link *link, void *context, int type, const char *endpoint, const mdl_security *security,
                  int sndhwm) {
    memset(link, 0, sizeof *link);
    link->since = mdl_now();
    link->endpoint = strdup(endpoint);
    link->socket = zmq_socket(context, type);
    link->monitor = zmq_socket(context, ZMQ_PAIR);
    char address[64];
    snprintf(address, sizeof address, "inproc://melissa-dl-monitor-%u", monitors++);
    int zero = 0;
    if (link->endpoint == NULL)
        errno = ENOMEM;
    int rc = link->endpoint && link->socket && link->monitor ? 0 : -1;
    if (rc == 0)
        rc = credentials(link->socket, security);
    if (rc == 0 && sndhwm > 0)
        rc = zmq_setsockopt(link->socket, ZMQ_SNDHWM, &sndhwm, sizeof sndhwm);
    if (rc == 0)
        rc = zmq_setsockopt(link->monitor, ZMQ_LINGER, &zero, sizeof zero);
    if (rc == 0)
        rc = zmq_socket_monitor(link->socket, address, EVENTS);
    if (rc == 0)
        rc = zmq_connect(link->monitor, address);
    if (rc == 0)
        rc = zmq_connect(link->socket, endpoint);
    if (rc != 0) {
        int error = errno;
        mdl_link_close(link);
        errno = error;
    }
    return rc;
}

void mdl_link_update(mdl_link *link) {
    for (;;) {
        zmq_msg_t event, address;
        zmq_msg_init(&event);
        if (zmq_msg_recv(&event, link->monitor, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&event);
            return;
        }
        uint16_t kind = 0;
        uint32_t value = 0;
        if (zmq_msg_size(&event) >= 6) { /* event (16 bits) and value (32 bits), native byte order */
            memcpy(&kind, zmq_msg_data(&event), 2);
            memcpy(&value, (const char *)zmq_msg_data(&event) + 2, 4);
        }
        bool more = zmq_msg_more(&event);
        zmq_msg_close(&event);
        if (more) { /* the endpoint */
            zmq_msg_init(&address);
            zmq_msg_recv(&address, link->monitor, 0);
            zmq_msg_close(&address);
        }
        if (kind == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            link->up = true;
            link->since = mdl_now();
        } else if (kind == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH || kind == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
            link->refused = kind;
            link->refused_value = value;
        } else if (kind == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
            link->failed_handshakes++;
        } else if (link->up) { /* disconnected: the server closed or died */
            link->up = false;
            link->since = mdl_now();
            link->drops++;
        }
    }
}

double mdl_link_down_for(const mdl_link *link) {
    return link->up ? 0 : mdl_now() - link->since;
}

static const struct {
    uint32_t value;
    const char *name;
} PROTOCOL_ERRORS[] = {
    {ZMQ_PROTOCOL_ERROR_ZMTP_UNSPECIFIED, "zmtp_unspecified"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_UNEXPECTED_COMMAND, "zmtp_unexpected_command"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_INVALID_SEQUENCE, "zmtp_invalid_sequence"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE, "zmtp_key_exchange"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_UNSPECIFIED, "zmtp_malformed_command_unspecified"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_MESSAGE, "zmtp_malformed_command_message"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_HELLO, "zmtp_malformed_command_hello"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_INITIATE, "zmtp_malformed_command_initiate"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_ERROR, "zmtp_malformed_command_error"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_READY, "zmtp_malformed_command_ready"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_WELCOME, "zmtp_malformed_command_welcome"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_INVALID_METADATA, "zmtp_invalid_metadata"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC, "zmtp_cryptographic"},
    {ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, "zmtp_mechanism_mismatch"},
    {ZMQ_PROTOCOL_ERROR_ZAP_UNSPECIFIED, "zap_unspecified"},
    {ZMQ_PROTOCOL_ERROR_ZAP_MALFORMED_REPLY, "zap_malformed_reply"},
    {ZMQ_PROTOCOL_ERROR_ZAP_BAD_REQUEST_ID, "zap_bad_request_id"},
    {ZMQ_PROTOCOL_ERROR_ZAP_BAD_VERSION, "zap_bad_version"},
    {ZMQ_PROTOCOL_ERROR_ZAP_INVALID_STATUS_CODE, "zap_invalid_status_code"},
    {ZMQ_PROTOCOL_ERROR_ZAP_INVALID_METADATA, "zap_invalid_metadata"},
};

void mdl_link_refusal(const mdl_link *link, char *out, size_t size) {
    if (link->refused == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
        snprintf(out, size, "credentials refused (ZAP status %u)", (unsigned)link->refused_value);
        return;
    }
    for (size_t i = 0; i < sizeof PROTOCOL_ERRORS / sizeof *PROTOCOL_ERRORS; i++)
        if (PROTOCOL_ERRORS[i].value == link->refused_value) {
            snprintf(out, size, "ZeroMQ security handshake failed: %s", PROTOCOL_ERRORS[i].name);
            return;
        }
    snprintf(out, size, "ZeroMQ security handshake failed: 0x%x", (unsigned)link->refused_value);
}

void mdl_link_close(mdl_link *link) {
    if (link->socket != NULL) {
        int zero = 0;
        zmq_socket_monitor(link->socket, NULL, 0);
        zmq_setsockopt(link->socket, ZMQ_LINGER, &zero, sizeof zero);
        zmq_close(link->socket);
    }
    if (link->monitor != NULL)
        zmq_close(link->monitor);
    free(link->endpoint);
    memset(link, 0, sizeof *link);
}
