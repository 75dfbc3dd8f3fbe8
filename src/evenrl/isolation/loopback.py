"""One way out of a contained worker: a TCP port on the worker's own loopback that leads to one Unix socket.

A reward worker lives in network namespaces of its own (evenrl.isolation.worker: only a loopback device, down), so
the code it runs reaches nothing. Agent code (rollout.agent) needs exactly one thing: the endpoint evenrl serves on a
Unix socket in the trainer. `open_endpoint(path)` brings the worker's loopback up and listens on 127.0.0.1 there,
relaying every connection to that socket: the agent gets an ordinary http://127.0.0.1:PORT base URL, every other
address stays unreachable (there is no other device), and the socket file is reachable across network namespaces
because it is a file. Where the kernel refused the namespaces (the pool's audit-hook fallback) there is no separate
loopback to open, and `open_endpoint` says so.

Being files, other processes' Unix sockets (under /tmp, /run: a session bus, a container engine) would be
reachable too. So `seal` (before the agent's module is imported) starts the one relay thread, then loads a seccomp
filter on the worker's main thread that refuses to create a Unix socket (socket(AF_UNIX), and io_uring, which
could make one around the filter): a filter binds the thread that loads it and what it starts from then on
(threads, processes, programs), never a thread started before, so the relay thread alone can still connect to the
endpoint, for every endpoint the worker is given. Socket pairs (asyncio's own) stay allowed: they connect nothing.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import queue
import selectors
import socket
import struct
import tempfile
import threading

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_CHUNK = 1 << 16
_OPEN: dict[str, int] = {}  # Unix socket path -> the port relaying to it, in this worker
_NEW: queue.SimpleQueue = queue.SimpleQueue()  # (listener, path) for the relay thread to take on
_WAKE: socket.socket | None = None  # written to wake the relay thread; set once sealed
_PR_SET_NO_NEW_PRIVS = 38


class NoLoopback(RuntimeError):
    """The worker is not in a network namespace of its own: nothing here could keep other addresses out."""


def seal() -> None:
    """(In a worker, once) start the relay thread, then refuse Unix sockets to this thread and all it starts."""
    global _WAKE
    if _WAKE is not None:
        return
    from evenrl.isolation import jail, worker

    if worker.NETWORK != "namespace":
        raise NoLoopback("agents need the worker's own network namespace (unprivileged user namespaces); this "
                         f"kernel refused them (network containment: {worker.NETWORK or 'none'})")
    program = _unix_socket_filter()  # first: without it nothing is started
    _loopback_up()
    wake, waker = socket.socketpair()
    threading.Thread(target=_relay, args=(wake,), daemon=True).start()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    jail.seccomp(program)
    _WAKE = waker


def open_endpoint(path: str) -> int:
    """The port on 127.0.0.1 that relays to the Unix socket `path` (opened once per worker and path)."""
    if path not in _OPEN:
        seal()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        _NEW.put((listener, path))
        _WAKE.send(b"\0")
        _OPEN[path] = listener.getsockname()[1]
    return _OPEN[path]


@functools.lru_cache(maxsize=1)
def _unix_socket_filter() -> bytes:
    """The BPF program refusing socket(AF_UNIX) (EACCES; the family compared on the low 32 bits, as the kernel reads
    it) and io_uring (EPERM), compiled by libseccomp as evenrl.isolation.syscalls compiles the sandbox's."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError) as e:
        raise NoLoopback("agents need libseccomp to keep them off other processes' Unix sockets: apt-get install "
                         f"libseccomp2 ({type(e).__name__}: {e})") from None
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)  # another ABI (int 0x80's socketcall): as in the sandbox
    f.add_rule(sc.ERRNO(errno.EACCES), "socket", sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, socket.AF_UNIX))
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        f.add_rule(sc.ERRNO(errno.EPERM), name)
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def _relay(wake: socket.socket) -> None:
    """One thread for every connection to every endpoint (a flood of requests costs sockets, not threads), never
    blocking on one of them: accept on the loopback, connect each to its listener's Unix socket, copy bytes both
    ways through per-socket buffers until either side closes; `wake` says a listener waits in _NEW."""
    sel = selectors.DefaultSelector()
    sel.register(wake, selectors.EVENT_READ)
    paths: dict[socket.socket, str] = {}  # listener -> its Unix socket
    peer: dict[socket.socket, socket.socket] = {}
    out: dict[socket.socket, bytearray] = {}  # bytes waiting to be sent to this socket

    def watch(s: socket.socket) -> None:
        sel.modify(s, selectors.EVENT_READ | (selectors.EVENT_WRITE if out[s] else 0))

    def close(s: socket.socket) -> None:
        for x in (s, peer.get(s)):
            if x is not None and x in out:
                sel.unregister(x)
                x.close()
                del out[x], peer[x]

    while True:
        for key, events in sel.select():
            sock = key.fileobj
            if sock is wake:
                wake.recv(64)
                while not _NEW.empty():
                    listener, path = _NEW.get()
                    paths[listener] = path
                    sel.register(listener, selectors.EVENT_READ)
                continue
            if sock in paths:
                client, _ = sock.accept()
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    upstream.connect(paths[sock])
                except OSError:
                    client.close()
                    upstream.close()
                    continue
                for a, b in ((client, upstream), (upstream, client)):
                    a.setblocking(False)
                    peer[a], out[a] = b, bytearray()
                    sel.register(a, selectors.EVENT_READ)
                continue
            if sock not in out:
                continue  # closed earlier in this round
            try:
                if events & selectors.EVENT_WRITE and out[sock]:
                    del out[sock][:sock.send(out[sock])]
                    watch(sock)
                if events & selectors.EVENT_READ:
                    data = sock.recv(_CHUNK)
                    if not data:
                        raise ConnectionResetError
                    out[peer[sock]] += data
                    watch(peer[sock])
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                close(sock)
