"""What idle or hostile TCP peers may cost a rank: connections and file descriptors.

Every TCP connection a ZeroMQ socket accepts costs a file descriptor, ZeroMQ
has no per-socket cap, and a process out of descriptors fails wherever it
next opens a file (a log, a checkpoint, ``/proc/self/statm``): a thousand idle
connections to a port could end the study. So:

- at start the soft open-file limit is raised to the hard one;
- each server socket gets a cap, ``connection_cap``, that leaves
  ``RESERVED_FDS`` descriptors to the rest of the process; a
  :class:`ConnectionGuard` follows the socket's monitor and shuts down any
  connection accepted beyond the cap at once, before its ZeroMQ handshake, so
  a legitimate peer has sent nothing yet, loses nothing and reconnects later;
- peers that never finish ZeroMQ's handshake are dropped after
  ``HANDSHAKE_MS`` (ZMQ_HANDSHAKE_IVL);
- an accept that failed anyway (no descriptor left) is counted and logged.

Refusals are counted under ``<name>_connections`` and ``<name>_accept_failed``.
"""
from __future__ import annotations

import logging
import os
import resource
import socket as tcp

import zmq
from zmq.utils.monitor import recv_monitor_message

from melissa_dl.rejections import RejectionLog

logger = logging.getLogger(__name__)

RESERVED_FDS = 256  # descriptors kept for logs, checkpoints, simulation launches, MPI
HANDSHAKE_MS = 10_000  # a peer silent this long after connecting is dropped
SOCKETS_PER_RANK = 2  # rank 0's handshake and data sockets share the process's descriptors
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED


def raise_open_file_limit() -> int:
    """Raise the soft limit of open files to the hard limit; return the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as error:
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, error)
    return soft


def connection_cap() -> int:
    """Connections one server socket may hold, so that all of them leave ``RESERVED_FDS`` descriptors free."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(8, (soft - RESERVED_FDS) // SOCKETS_PER_RANK)


class ConnectionGuard:
    """Keeps a bound socket's connections under a cap; call :meth:`check` from the socket's own thread."""

    def __init__(self, socket: zmq.Socket, name: str, rejections: RejectionLog, cap: int | None = None) -> None:
        socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        self.monitor = socket.get_monitor_socket(_EVENTS)
        self.cap = connection_cap() if cap is None else cap
        self.open = 0
        self._socket = socket
        self._name = name
        self._rejections = rejections

    def check(self) -> None:
        """Handle the monitor's pending events without waiting."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind = event["event"]
            if kind == zmq.EVENT_ACCEPTED:
                self.open += 1
                if self.open > self.cap:
                    self._shut(event["value"])
            elif kind == zmq.EVENT_DISCONNECTED:
                self.open = max(0, self.open - 1)
            elif kind == zmq.EVENT_ACCEPT_FAILED:
                self._rejections.reject(f"{self._name}_accept_failed",
                                        f"{self._name} socket: accept failed: {os.strerror(event['value'])}")

    def _shut(self, fd: int) -> None:
        """End a connection ZeroMQ just accepted; ZeroMQ sees it close and releases the descriptor."""
        self._rejections.reject(f"{self._name}_connections",
                                f"{self._name} socket: {self.open - 1} connections open, cap {self.cap}: "
                                "closing a new one (raise `ulimit -n` for more)")
        try:
            duplicate = tcp.socket(fileno=os.dup(fd))
        except OSError:  # already closed by ZeroMQ
            return
        try:
            duplicate.shutdown(tcp.SHUT_RDWR)
        except OSError:
            pass  # the peer left first: ZeroMQ reports it disconnected as well
        finally:
            duplicate.close()

    def close(self) -> None:
        self._socket.disable_monitor()
        self.monitor.close(linger=0)
