"""A loopback TCP proxy that outage tests can cut and restore.

Stopping the real server is slow and takes it away from every other test;
cutting a proxy in front of it takes it away from one client only, at an
exact moment (psycopg's ``tests/fix_proxy.py`` does the same with
``pproxy``).  This one is a few threads on the standard library.

While cut, the proxy still accepts connections but resets them at once, so a
client fails fast (as when a server is down), and its port stays ours so
``restore()`` cannot find it taken.

While stalled (``stall()``), it forwards nothing in either direction but keeps
every socket open and still accepts new connections, which then wait: the
client sees a server that stopped answering without closing anything (a
partition, a failover that moved the address, a proxy that hangs). TCP
keepalives and server-side timeouts cannot see that, since the proxy still
ACKs every byte. ``resume()`` forwards again what was held (a healed
partition), or with ``reset=True`` resets every connection opened before it
(the old address is gone, as after a failover).

With a fault schedule (``inject()``), it fails single HTTP requests instead of
the whole link: the three ways a request can go wrong for a client that
retries (the server never saw it, the server acted but its answer was lost,
the answer came too late), so a retrying client is tested on each one, at
random and many times over, against a real server whose work can be counted.
"""

from __future__ import annotations

import enum
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

from ._procs import LOOPBACK
from .lifecycle import ClosesOnExit

DEFAULT_PORTS = {"postgres": 5432, "postgresql": 5432, "redis": 6379, "http": 80}


def _abortive(sock: socket.socket) -> None:
    """Make ``close()`` send a TCP RST instead of a FIN (SO_LINGER with no time)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST instead of a FIN: the peer fails immediately."""
    _abortive(sock)
    sock.close()


class Fault(enum.Enum):
    """What ``TcpProxy.inject()`` does to one HTTP request. Each ends in a reset of
    the client, never a FIN: a FIN right after a request looks like a server
    closing an idle keep-alive connection, which some HTTP stacks answer by
    resending on their own, and that would hide the very retry under test."""

    #: Reset the client at the request's first bytes, forwarding none: the server
    #: never saw the request, so a retry is its first execution.
    RESET_BEFORE = "reset_before"
    #: Forward the request and let the server answer, then reset the client instead
    #: of delivering the answer: the server acted and the client never hears, so a
    #: retry must be answered with the stored response, not a second execution.
    DROP_AFTER = "drop_after"
    #: As DROP_AFTER, but the answer is held for the schedule's ``hold_seconds``
    #: first, on a connection that stays open: the client's own timeout must end the
    #: attempt (a server that acted, then a network that went quiet).
    HOLD = "hold"


#: Called once per HTTP request the proxy sees: the fault for it, or ``None``.
FaultSchedule = Callable[[], Fault | None]
#: How long a ``HOLD`` keeps its answer unless ``inject()`` says otherwise.
DEFAULT_HOLD_SECONDS = 3.0


class ScriptedFaults:
    """A schedule that plays the given faults in order, then ``None``; ``calls``
    counts the requests it was asked about (``ScriptedFaults()``: a counter)."""

    def __init__(self, *faults: Fault | None) -> None:
        self.faults = list(faults)
        self.calls = 0

    def __call__(self) -> Fault | None:
        self.calls += 1
        return self.faults.pop(0) if self.faults else None


class _Faults:
    """The proxy's fault schedule and the count of faults applied, shared by its links.

    The schedule is called under a lock, so a seeded ``random.Random`` in it gives
    the same sequence of faults whatever the threads do (which request gets which
    one still depends on their timing).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._schedule: FaultSchedule | None = None
        self.hold_seconds = DEFAULT_HOLD_SECONDS
        self._applied: Counter[Fault] = Counter()
        #: Set by ``TcpProxy.close()``: ends every hold at once.
        self.closing = threading.Event()

    def set(self, schedule: FaultSchedule | None, hold_seconds: float) -> None:
        with self._lock:
            self._schedule = schedule
            self.hold_seconds = hold_seconds

    def draw(self) -> Fault | None:
        with self._lock:
            return self._schedule() if self._schedule is not None else None

    def applied(self, fault: Fault) -> None:
        with self._lock:
            self._applied[fault] += 1

    def counts(self) -> Counter[Fault]:
        with self._lock:
            return Counter(self._applied)


class _Link:
    """One proxied connection: a client socket and its upstream socket.

    Two pump threads copy bytes, one per direction.  Only they close the
    sockets (the last one to finish), so a socket is never closed under a
    thread still reading it; anyone else ends a link with ``abort()``,
    which shuts the sockets down and so wakes the pumps.

    For fault injection the link tells HTTP/1.1 requests apart without parsing
    them: with keep-alive and no pipelining, a request is the first client bytes
    of a connection or the first after the server has begun to answer. The fault
    drawn at a request's first bytes is applied there (``RESET_BEFORE``) or at
    its answer's first bytes (``DROP_AFTER``, ``HOLD``).
    """

    def __init__(self, client: socket.socket, upstream: socket.socket, faults: _Faults) -> None:
        self.client = client
        self.upstream = upstream
        self._lock = threading.Lock()
        self._pumps_left = 2
        self._faults = faults
        #: The client's next bytes start a request. Written by one pump before it
        #: forwards the bytes the other pump's next read depends on, so the two
        #: never race.
        self._awaiting_request = True
        #: The fault drawn for the request in flight, for its answer.
        self._fault: Fault | None = None
        #: The client was reset by a fault: nothing may FIN it first.
        self._client_reset = False

    def abort(self) -> None:
        shut = [self.upstream] if self._client_reset else [self.client, self.upstream]
        for sock in shut:  # a reset client gets no FIN after its RST
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _reset_client(self) -> None:
        """End the link with a RST to the client. SHUT_RD wakes a pump reading the
        client without sending the client anything; the last pump's ``close()``
        then sends the RST (SO_LINGER 0)."""
        self._client_reset = True
        _abortive(self.client)
        try:
            self.client.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        try:
            self.upstream.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _passes(self, src: socket.socket) -> bool:
        """Whether bytes just read from ``src`` go on, or a fault ended the link."""
        if src is self.client:
            if not self._awaiting_request:
                return True  # more of the same request
            self._awaiting_request = False
            self._fault = self._faults.draw()
            if self._fault is not Fault.RESET_BEFORE:
                return True
            self._faults.applied(self._fault)
            self._reset_client()
            return False
        fault, self._fault = self._fault, None
        self._awaiting_request = True
        if fault is None:
            return True
        self._faults.applied(fault)  # a hold counts from its start
        if fault is Fault.HOLD:
            self._faults.closing.wait(self._faults.hold_seconds)
        self._reset_client()
        return False

    def pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        on_closed: Callable[[_Link], None],
        flowing: threading.Event,
    ) -> None:
        try:
            while data := src.recv(65536):
                flowing.wait()  # held, not dropped, while the proxy is stalled
                if not self._passes(src):
                    break
                dst.sendall(data)
            if not self._client_reset:
                dst.shutdown(socket.SHUT_WR)  # pass the half-close on
        except OSError:
            self.abort()
        with self._lock:
            self._pumps_left -= 1
            last = self._pumps_left == 0
        if last:
            self.client.close()
            self.upstream.close()
            on_closed(self)


class TcpProxy(ClosesOnExit):
    """Listens on 127.0.0.1:<free port> and forwards to ``target``.

    Make one with ``TcpProxy(host, port)`` or ``TcpProxy.for_url(url)``;
    ``url`` is then that URL pointing at the proxy instead.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        target_url: str | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        self.target = (target_host, target_port)
        self._target_url = target_url
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._cut = False
        self._closed = False
        #: Set while bytes flow; cleared by ``stall()``.
        self._flowing = threading.Event()
        self._flowing.set()
        #: How many ``resume(reset=True)`` happened: a connection accepted before
        #: one of them is reset instead of connected.
        self._resets = 0
        self._links: set[_Link] = set()
        self._faults = _Faults()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server((LOOPBACK, 0))
        # A timeout rather than a shutdown() from close() to end accept():
        # the accept thread alone closes the listener, portably.
        self._listener.settimeout(0.1)
        self.host = LOOPBACK
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"TcpProxy:{self.port}", daemon=True
        )
        self._acceptor.start()

    @classmethod
    def for_url(cls, url: str, *, connect_timeout: float = 5.0) -> TcpProxy:
        """A proxy in front of the server a ``postgresql://`` or ``redis://`` URL names."""
        parts = urlsplit(url)
        if not parts.hostname or parts.hostname.startswith("/"):
            raise ValueError(f"cannot proxy {url!r}: it names no TCP host")
        port = parts.port or DEFAULT_PORTS.get(parts.scheme)
        if port is None:
            raise ValueError(f"cannot proxy {url!r}: no port and no default for {parts.scheme!r}")
        return cls(parts.hostname, port, target_url=url, connect_timeout=connect_timeout)

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def url(self) -> str:
        """The URL the proxy was made for, pointing at the proxy."""
        if self._target_url is None:
            raise RuntimeError("this proxy was not made from a URL; use url_for()")
        return self.url_for(self._target_url)

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's (userinfo kept)."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{self.host}:{self.port}" if userinfo else f"{self.host}:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    @property
    def is_cut(self) -> bool:
        return self._cut

    @property
    def is_stalled(self) -> bool:
        return not self._flowing.is_set()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._links)

    def cut(self) -> None:
        """Drop every open connection and reset new ones until ``restore()``."""
        with self._lock:
            self._cut = True
            links = list(self._links)
        for link in links:
            link.abort()

    def restore(self) -> None:
        """Let new connections through again (cut ones stay closed)."""
        with self._lock:
            self._cut = False

    def stall(self) -> None:
        """Stop forwarding in both directions, keeping every socket open; new
        connections are accepted but not forwarded either, until ``resume()``."""
        self._flowing.clear()

    def resume(self, *, reset: bool = False) -> None:
        """Forward again. What was held while stalled is delivered, unless
        ``reset``: then every connection opened before now is reset instead."""
        if reset:
            with self._lock:
                self._resets += 1
                links = list(self._links)
            for link in links:
                link.abort()
        self._flowing.set()

    def inject(
        self, schedule: FaultSchedule | None, *, hold_seconds: float = DEFAULT_HOLD_SECONDS
    ) -> None:
        """Fail HTTP requests as ``schedule`` says (see ``Fault``), or stop with ``None``.

        ``schedule()`` is called once for each HTTP/1.1 request on any connection
        (keep-alive, no pipelining), from the proxy's threads, one call at a time.
        A ``HOLD`` keeps its answer ``hold_seconds``: make that longer than the
        client's timeout. Requests already in flight keep the fault they drew.
        """
        self._faults.set(schedule, hold_seconds)

    @property
    def faults(self) -> Counter[Fault]:
        """How many of each fault were applied so far (a copy)."""
        return self._faults.counts()

    def close(self) -> None:
        """Stop listening, drop every connection and wait for the threads."""
        self._faults.closing.set()
        with self._lock:
            self._closed = True
            links = list(self._links)
        for link in links:
            link.abort()
        self._flowing.set()  # wake held pumps and connections; they find the sockets shut
        self._acceptor.join(5)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(5)

    def _accept_loop(self) -> None:
        try:
            while not self._closed:
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    time.sleep(0.05)  # out of descriptors, say: try again shortly
                    continue
                with self._lock:
                    if self._cut or self._closed:
                        _reset(client)
                        continue
                    self._start_thread(self._connect, client, self._resets)
        finally:
            self._listener.close()

    def _start_thread(self, target: Callable[..., None], *args: object) -> None:
        """Start a daemon worker thread; caller holds ``self._lock``."""
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _connect(self, client: socket.socket, resets: int) -> None:
        client.settimeout(None)
        self._flowing.wait()  # accepted while stalled: connect only once resumed
        if self._resets != resets:
            _reset(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=self.connect_timeout)
        except OSError:
            _reset(client)  # upstream down: the client sees a refused-like reset
            return
        upstream.settimeout(None)
        link = _Link(client, upstream, self._faults)
        with self._lock:
            if self._cut or self._closed:
                _reset(client)
                upstream.close()
                return
            self._links.add(link)
            self._start_thread(link.pump, client, upstream, self._forget, self._flowing)
            self._start_thread(link.pump, upstream, client, self._forget, self._flowing)

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)

    def __repr__(self) -> str:
        state = "cut" if self._cut else "stalled" if self.is_stalled else "open"
        return f"<TcpProxy {self.host}:{self.port} -> {self.target[0]}:{self.target[1]} {state}>"
