/* A client socket with the study's credentials, and what its monitor says of
 * its connection (the C side of _Link in melissa_dl/wire/client.py). */
#ifndef MELISSA_DL_LINK_H
#define MELISSA_DL_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { SECURITY_TOKEN = 0, SECURITY_CURVE = 1 };

typedef struct {
    int level;             /* SECURITY_TOKEN or SECURITY_CURVE */
    const char *token;     /* PLAIN password: the study's token (hex) */
    const char *curve[3];  /* CURVE server public, client public, client secret keys (Z85) */
} mdl_security;

typedef struct {
    void *socket;
    void *monitor;  /* a PAIR socket receiving the socket's events */
    char *endpoint;
    bool up;        /* the last ZeroMQ handshake succeeded and no disconnection since */
    double since;   /* when ``up`` last changed (or the link opened) */
    int refused;    /* 0, or ZMQ_EVENT_HANDSHAKE_FAILED_AUTH / _PROTOCOL: the server refused us, for good */
    uint32_t refused_value;
    unsigned failed_handshakes; /* connections closed midway, as a CURVE server does with a wrong server key */
    unsigned drops;             /* connections lost: what was in flight on them may be lost */
} mdl_link;

double mdl_now(void);

/* The level's name ("token" or "curve"). */
const char *mdl_security_name(int level);

/* Open a socket of ``type`` in ``context`` with ``security``'s credentials and
 * a monitor (``sndhwm`` > 0 sets ZMQ_SNDHWM), connected to ``endpoint``.
 * Returns 0, or -1 with errno set (the link is then closed). */
int mdl_link_open(mdl_link *link, void *context, int type, const char *endpoint, const mdl_security *security,
                  int sndhwm);

/* Take the monitor's pending events. */
void mdl_link_update(mdl_link *link);

/* Seconds the link has been down (0 while up). */
double mdl_link_down_for(const mdl_link *link);

/* Words for the refusal (``refused`` != 0), as melissa_dl.wire.security.describe_handshake_failure. */
void mdl_link_refusal(const mdl_link *link, char *out, size_t size);

/* Stop the monitor and close the socket at once, dropping what is queued. */
void mdl_link_close(mdl_link *link);

#endif
