"""What idle or hostile TCP peers may cost a rank: connections, file descriptors and memory.

Every TCP connection a ZeroMQ socket accepts costs a file descriptor, ZeroMQ
has no per-socket cap, and a process out of descriptors fails wherever it
next opens a file (a log, a checkpoint, ``/proc/self/statm``): a thousand idle
connections to a port could end the study. And before a peer has logged in
(ZeroMQ's security handshake, checked by the ZAP handler of
:mod:`melissa_dl.wire.security`), ZeroMQ reads whatever it sends into one message
part, up to the socket's cap (``ZMQ_MAXMSGSIZE``, which libzmq applies to the
login as to the data: about ``PART_BYTES`` on a data socket, a hello's size on
the handshake socket, a kilobyte on a delivery service). So:

- at start the soft open-file limit is raised to the hard one;
- each server socket gets a cap, ``connection_cap``, that leaves
  ``RESERVED_FDS`` descriptors to the rest of the process, and admits at
  most ``PENDING_PER_HOST`` connections still logging in from one other host
  (a peer of this host, where the launcher's simulations run, counts in the
  total only) and ``PENDING_IN_ALL`` in all: a :class:`ConnectionGuard`
  follows the socket's monitor and shuts down any connection accepted beyond
  a cap at once, so a legitimate peer has sent nothing yet, loses nothing and
  reconnects later (the guard reads the monitor's latest news first: the
  descriptor of a connection that ended may be another's already); what
  peers without credentials can make a socket hold is at most
  ``PENDING_IN_ALL`` parts at a time;
- peers that do not finish ZeroMQ's handshake within ``HANDSHAKE_MS``
  (ZMQ_HANDSHAKE_IVL) are dropped;
- an accept that failed anyway (no descriptor left) is counted and logged.

Every refused connection is counted, in the socket's
:class:`~melissa_dl.wire.rejections.RejectionLog`, under ``<name>_auth`` (no or
another mechanism, a failed key exchange, and the wrong credentials that the
ZAP handler refuses), ``<name>_noauth`` (ended before its login was done: an
idle or scanning peer, a peer whose mismatch its own side saw first, a client
that quit at once: logged at INFO when its peer closed it, a process that
ended while it connected), ``<name>_cut`` (closed by ZeroMQ before its login: not
ZMTP, or a message part over the cap; libzmq says which of the two to no one),
``<name>_connections`` (beyond a cap) and ``<name>_accept_failed``.
libzmq names a connection's descriptor only when it accepts it and when it
ends it, so :class:`Logins` follows each connection from those and from what
the ZAP handler admits.
:class:`ServerSocketThread` is the one place where a server socket is made,
guarded, bound, polled and closed; the receiver, the delivery service and the
handshake service only say what to do with what arrives.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket as tcp
import threading
from abc import ABC, abstractmethod
from collections import Counter, deque

import zmq

from melissa_dl.wire.rejections import RejectionLog
from melissa_dl.wire.security import Gate, Security, describe_handshake_failure, monitor_event

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a socket's thread looks at its stop flag and its monitor
RESERVED_FDS = 256  # descriptors kept for logs, checkpoints, simulation launches, MPI
# A login not done this long after its connection is dropped: a silent peer's, or a real client's that the server
# itself was slow to admit (a thousand logging in at once on a loaded node), which reconnects; libzmq's default.
HANDSHAKE_MS = 30_000
SOCKETS_PER_RANK = 3  # rank 0's handshake, data and delivery sockets share the process's descriptors
PENDING_PER_HOST = 64  # connections of one host still logging in, per socket
PENDING_IN_ALL = 256  # of all hosts, or the simulation ranks the study may run at once if more
_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_ACCEPT_FAILED
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


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


class Logins:
    """One socket's connections, from the monitor's events and the ZAP handler's admissions: how many are still
    logging in, from which host, and how each one that never logged in ended.

    The events that name a descriptor are only a connection's accept and its
    end; a login that succeeded names none, and logins do not end in the order
    their connections began. So a success is owed to its host (the one the ZAP
    handler admitted last but not yet owed), and the next end of one of that
    host's connections with no reason of its own pays it back: a logged-in
    connection that ended. A login failure that has an event of its own (no
    detail, protocol) comes right before its connection's end (libzmq emits
    both in one call of its one I/O thread); a ZAP refusal (counted by the
    handler) is followed by an end of its own; any other end is a cut. The
    counts are exact once the connections concerned have ended.
    """

    def __init__(self, per_host: int = PENDING_PER_HOST, in_all: int = PENDING_IN_ALL) -> None:
        self.per_host, self.in_all = per_host, in_all
        self.admitted: deque[str] = deque(maxlen=in_all)  # hosts the ZAP handler admitted (its thread appends)
        self._hosts: dict[int, str] = {}  # open connection -> its host ('': unknown, it closed at once)
        self._open: Counter[str] = Counter()  # host -> its open connections
        self._owed: Counter[str] = Counter()  # host -> logins that succeeded, their connections still open
        self._failed = False  # the last event was a failed login: the next end is that connection's
        self._refused = 0  # logins the ZAP handler refused whose connection has not ended yet

    @property
    def open(self) -> int:
        return len(self._hosts)

    def waiting(self, host: str | None = None) -> int:
        """Connections still logging in, of ``host`` or of all."""
        if host is None:
            return len(self._hosts) - self._owed.total()
        return self._open[host] - self._owed[host]

    def accepted(self, fd: int, host: str, remote: bool = True) -> str | None:
        """A new connection (host '': closed already; not ``remote``: of this host, under no cap of its own); why
        it must be shut instead of followed (a cap it is beyond), if it must."""
        if host and remote and (waiting := self.waiting(host)) >= self.per_host:
            return f"{waiting} connections from {host} still logging in, at most {self.per_host}"
        if host and (waiting := self.waiting()) >= self.in_all:
            return f"{waiting} connections still logging in, at most {self.in_all}"
        self._hosts[fd] = host
        self._open[host] += 1
        return None

    def succeeded(self) -> None:
        self._owed[self.admitted.popleft() if self.admitted else ""] += 1

    def failed(self) -> None:
        """A login failed with an event of its own, counted by the caller."""
        self._failed = True

    def refused(self) -> None:
        """The ZAP handler refused a login (and counted it)."""
        self._refused += 1

    def ended(self, fd: int) -> bool:
        """A connection ended: whether it was a cut (ended while logging in, for no reason counted yet)."""
        failed, self._failed = self._failed, False
        if fd not in self._hosts:
            return False  # shut by the guard
        host = self._hosts.pop(fd)
        self._open[host] -= 1
        if failed:
            return False
        owed = host if self._owed[host] else None
        if owed is None and not host:  # closed before its host was read: any host's login
            owed = next((h for h, n in self._owed.items() if n), None)
        if owed is not None:
            self._owed[owed] -= 1
            return False
        if self._refused:
            self._refused -= 1
            return False
        return True


class ConnectionGuard:
    """Keeps a bound socket's connections under its caps and counts every refused one; call :meth:`check` from
    the socket's own thread."""

    def __init__(
        self,
        socket: zmq.Socket,
        name: str,
        rejections: RejectionLog,
        cap: int | None = None,
        logins: Logins | None = None,
    ) -> None:
        socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        self.monitor = socket.get_monitor_socket(_EVENTS)
        self.cap = connection_cap() if cap is None else cap
        self.logins = Logins() if logins is None else logins
        self.port = 0  # the socket's, once bound
        self._events: deque[tuple[int, int]] = deque()  # read from the monitor, not handled yet
        self._ends: Counter[int] = Counter()  # descriptor -> its DISCONNECTED events among them
        self._shut_in_handshake = (
            0  # connections this guard closed: their failed handshakes are no refusal of their own
        )
        self._socket = socket
        self._name = name
        self._rejections = rejections

    def admitted(self, host: str) -> None:
        """The ZAP handler admitted a peer of ``host`` (called from its thread)."""
        self.logins.admitted.append(host)

    def check(self) -> None:
        """Handle the monitor's pending events without waiting (those that come meanwhile: at the next call)."""
        self._drain()
        for _ in range(len(self._events)):
            kind, value = self._events.popleft()
            if kind == zmq.EVENT_ACCEPTED:
                self._drain()  # the latest news: a connection that ended already, its descriptor may be another's
                self._accepted(value, open=not self._ends[value])
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.logins.succeeded()
            elif kind == zmq.EVENT_DISCONNECTED:
                self._ends[value] -= 1
                if not self._ends[value]:
                    del self._ends[value]
                if self.logins.ended(value):
                    self._rejections.reject(
                        f"{self._name}_cut",
                        f"{self._name} socket: ZeroMQ closed a connection "
                        "before its login: not ZMTP, or a message part over the socket's cap",
                    )
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.logins.refused()  # counted by the ZAP handler
            else:
                self._failed(kind, value)

    def _drain(self) -> None:
        """Queue the monitor's events; count the ends queued per descriptor."""
        while self.monitor.poll(0):
            kind, value = monitor_event(self.monitor)
            self._events.append((kind, value))
            if kind == zmq.EVENT_DISCONNECTED:
                self._ends[value] += 1

    def _failed(self, kind: int, value: int) -> None:
        if kind == zmq.EVENT_ACCEPT_FAILED:
            self._rejections.reject(
                f"{self._name}_accept_failed", f"{self._name} socket: accept failed: {os.strerror(value)}"
            )
            return
        self.logins.failed()
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:  # wrong credentials are counted by the ZAP handler
            self._rejections.reject(
                f"{self._name}_auth",
                f"{self._name} socket: a peer without the study's "
                f"credentials: {describe_handshake_failure(kind, value)}",
            )
        elif self._shut_in_handshake > 0:  # one this guard closed, counted already
            self._shut_in_handshake -= 1
        elif value in (errno.ECONNRESET, errno.EPIPE):  # its peer closed it (a FIN or an RST): no security matter
            self._rejections.reject(
                f"{self._name}_noauth",
                f"{self._name} socket: a connection closed by its peer before its login was done (a process "
                "that ended or gave up while it connected)",
                logging.INFO,
            )
        else:
            self._rejections.reject(
                f"{self._name}_noauth",
                f"{self._name} socket: a connection ended before "
                f"ZeroMQ's security handshake was done ({os.strerror(value)})",
            )

    def _accepted(self, fd: int, open: bool) -> None:
        connection = self._connection(fd) if open else None
        try:
            host = str(connection.getpeername()[0]) if connection is not None else ""  # '': its end comes next
            why: str | None
            if host and self.logins.open >= self.cap:
                why = (
                    f"{self.logins.open} connections open, cap {self.cap}: closing a new one "
                    "(raise `ulimit -n` for more)"
                )
            else:  # a peer of this host (its address is ours) is under the cap of all, not that of one host
                why = self.logins.accepted(
                    fd, host, remote=connection is not None and host != connection.getsockname()[0]
                )
                why = why and f"{why}: closing a new one"
            if why and connection is not None:
                self._rejections.reject(f"{self._name}_connections", f"{self._name} socket: {why}")
                self._shut(connection)
        finally:
            if connection is not None:
                connection.close()

    def _connection(self, fd: int) -> tcp.socket | None:
        """A copy of a connection ZeroMQ accepted on this socket's port, or None if the descriptor is closed or is
        another's now (ZeroMQ may close a connection, and the number be reused, before its events are read)."""
        try:
            copy = os.dup(fd)
        except OSError:
            return None
        try:
            connection = tcp.socket(fileno=copy)
        except OSError:  # not a socket
            os.close(copy)  # a leaked copy of a pipe's write end would keep its reader from ever seeing its end
            return None
        try:
            if (
                connection.family in (tcp.AF_INET, tcp.AF_INET6)
                and connection.type == tcp.SOCK_STREAM
                and connection.getsockname()[1] == self.port
            ):
                connection.getpeername()  # connected
                return connection
        except OSError:
            pass
        connection.close()
        return None

    def _shut(self, connection: tcp.socket) -> None:
        """End a connection ZeroMQ just accepted; ZeroMQ sees it close and releases the descriptor."""
        try:
            connection.shutdown(tcp.SHUT_RDWR)
            self._shut_in_handshake += 1
        except OSError:
            pass  # the peer left first: ZeroMQ reports it disconnected as well

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
        """Called at every turn of the thread's loop, at least every ``wait_ms()``: work that waits on time."""

    def wait_ms(self) -> int:
        """How long the thread's next turn may wait for its socket: ``POLL_MS``, or less while work is due sooner."""
        return POLL_MS

    def run(self) -> None:
        try:
            socket: zmq.Socket[bytes] = zmq.Context.instance().socket(self.socket_type)
            # before bind: the listener copies options; every simulation rank the study may run may log in at once
            logins = Logins(in_all=max(PENDING_IN_ALL, self.security.peers))
            guard = ConnectionGuard(socket, self.guard_name, self.rejections, logins=logins)
            gate = None
            try:
                gate = Gate(
                    socket,
                    self.security,
                    self.rejections,
                    self.guard_name,
                    self.message_cap,  # before bind too
                    guard.admitted,
                )
                self.configure(socket)
                address = f"tcp://{self._bind_address}"
                if self.port:
                    socket.bind(f"{address}:{self.port}")
                else:
                    self.port = socket.bind_to_random_port(address)
                guard.port = self.port
                self._ready.set()
                poller = zmq.Poller()
                poller.register(socket, zmq.POLLIN)
                poller.register(guard.monitor, zmq.POLLIN)
                while not self._stop_event.is_set():
                    ready = dict(poller.poll(self.wait_ms()))
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
