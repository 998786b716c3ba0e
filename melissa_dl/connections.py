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

Refusals are counted under ``<name>_connections`` and ``<name>_accept_failed``;
a peer that fails ZeroMQ's security handshake (no or another mechanism, a
wrong CURVE server key) under ``<name>_auth``, like the wrong credentials
that the ZAP handler refuses (:mod:`melissa_dl.security`), and a connection
that ends before that handshake is done (an idle or scanning peer, a peer
whose mismatch its own side saw first, a client that quit at once) under
``<name>_noauth``.
:class:`ServerSocketThread` is the one place where a server socket is made,
guarded, bound, polled and closed; the receiver, the delivery service and the
handshake service only say what to do with what arrives.
"""
from __future__ import annotations

import logging
import os
import resource
import socket as tcp
import threading
from abc import ABC, abstractmethod

import zmq

from melissa_dl.rejections import RejectionLog
from melissa_dl.security import Gate, Security, describe_handshake_failure, monitor_event

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a socket's thread looks at its stop flag and its monitor
RESERVED_FDS = 256  # descriptors kept for logs, checkpoints, simulation launches, MPI
HANDSHAKE_MS = 10_000  # a peer silent this long after connecting is dropped
SOCKETS_PER_RANK = 3  # rank 0's handshake, data and delivery sockets share the process's descriptors
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


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
        self._shut_in_handshake = 0  # connections this guard closed: their failed handshakes are no refusal of their own
        self._socket = socket
        self._name = name
        self._rejections = rejections

    def check(self) -> None:
        """Handle the monitor's pending events without waiting."""
        while self.monitor.poll(0):
            kind, value = monitor_event(self.monitor)
            if kind == zmq.EVENT_ACCEPTED:
                self.open += 1
                if self.open > self.cap:
                    self._shut(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.open = max(0, self.open - 1)
            elif kind == zmq.EVENT_ACCEPT_FAILED:
                self._rejections.reject(f"{self._name}_accept_failed",
                                        f"{self._name} socket: accept failed: {os.strerror(value)}")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:  # wrong credentials are counted by the ZAP handler
                self._rejections.reject(f"{self._name}_auth", f"{self._name} socket: a peer without the study's "
                                        f"credentials: {describe_handshake_failure(kind, value)}")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                if self._shut_in_handshake > 0:  # one this guard closed, counted already
                    self._shut_in_handshake -= 1
                else:
                    self._rejections.reject(f"{self._name}_noauth", f"{self._name} socket: a connection ended before "
                                            f"ZeroMQ's security handshake was done ({os.strerror(value)})")

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
            self._shut_in_handshake += 1
        except OSError:
            pass  # the peer left first: ZeroMQ reports it disconnected as well
        finally:
            duplicate.close()

    def close(self) -> None:
        self._socket.disable_monitor()
        self.monitor.close(linger=0)


class ServerSocketThread(threading.Thread, ABC):
    """A thread owning one bound server socket, from its creation to its close, under a :class:`ConnectionGuard`.

    An exception in the thread is kept in ``error`` for the main thread, which ends the job.
    """

    socket_type: int
    guard_name: str

    def __init__(self, name: str, bind_address: str, port: int = 0, *, security: Security, message_cap: int) -> None:
        super().__init__(name=name, daemon=True)
        self.security = security
        self.message_cap = message_cap  # ZMQ_MAXMSGSIZE: a larger message part ends its connection unread
        self.rejections = RejectionLog()
        self.port = port
        self.error: BaseException | None = None
        self._bind_address = bind_address
        self._stop_event = threading.Event()
        self._ready = threading.Event()

    def start_and_bind(self, timeout: float = 30.0) -> int:
        """Start the thread and return the port its socket is bound to."""
        self.start()
        if not self._ready.wait(timeout):
            self.error = TimeoutError(f"{self.name}: the socket was not bound within {timeout:g} s")
        self.check()
        return self.port

    def check(self) -> None:
        """Re-raise in the caller's thread an exception that ended this thread."""
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Stop serving and wait for the thread; the socket closes with it."""
        self._stop_event.set()
        if self.ident is not None:  # started
            self.join()

    def configure(self, socket: zmq.Socket) -> None:
        """Socket options that must be set before bind."""

    @abstractmethod
    def handle(self, socket: zmq.Socket, guard: ConnectionGuard) -> None:
        """Serve one readable event of the socket (``guard.check()`` while waiting long)."""

    def idle(self, socket: zmq.Socket) -> None:
        """Called at every turn of the thread's loop, at least every ``POLL_MS``: work that waits on time."""

    def run(self) -> None:
        try:
            socket = zmq.Context.instance().socket(self.socket_type)
            guard = ConnectionGuard(socket, self.guard_name, self.rejections)  # before bind: the listener copies options
            gate = None
            try:
                gate = Gate(socket, self.security, self.rejections, self.guard_name, self.message_cap)  # before bind too
                self.configure(socket)
                address = f"tcp://{self._bind_address}"
                if self.port:
                    socket.bind(f"{address}:{self.port}")
                else:
                    self.port = socket.bind_to_random_port(address)
                self._ready.set()
                poller = zmq.Poller()
                poller.register(socket, zmq.POLLIN)
                poller.register(guard.monitor, zmq.POLLIN)
                while not self._stop_event.is_set():
                    ready = dict(poller.poll(POLL_MS))
                    guard.check()
                    if socket in ready:
                        self.handle(socket, guard)
                    self.idle(socket)
            finally:
                guard.close()
                socket.close(linger=0)
                if gate is not None:  # after the close: a CURVE socket without ZAP handler would admit anyone
                    gate.close()
        except BaseException as error:  # handed to the main thread, which ends the job
            self.error = error
            self._ready.set()
