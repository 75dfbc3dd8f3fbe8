"""One way out of a contained worker: a TCP port on the worker's own loopback that leads to one Unix socket.

A reward worker lives in network namespaces of its own (evenrl.isolation.worker: only a loopback device, down), so
the code it runs reaches nothing. Agent code (rollout.agent) needs exactly one thing: the endpoint evenrl serves on a
Unix socket in the trainer. `open_endpoint(path)` brings the worker's loopback up and listens on 127.0.0.1 there,
relaying every connection to that socket: the agent gets an ordinary http://127.0.0.1:PORT base URL, every other
address stays unreachable (there is no other device), and the socket file is reachable across network namespaces
because it is a file. Where the kernel refused the namespaces (the pool's audit-hook fallback) there is no separate
loopback to open, and `open_endpoint` says so.
"""

from __future__ import annotations

import fcntl
import selectors
import socket
import struct
import threading

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_CHUNK = 1 << 16
_OPEN: dict[str, int] = {}  # Unix socket path -> the port relaying to it, in this worker


class NoLoopback(RuntimeError):
    """The worker is not in a network namespace of its own: nothing here could keep other addresses out."""


def open_endpoint(path: str) -> int:
    """The port on 127.0.0.1 that relays to the Unix socket `path` (opened once per worker and path)."""
    if path not in _OPEN:
        from evenrl.isolation import worker

        if worker.NETWORK != "namespace":
            raise NoLoopback("agents need the worker's own network namespace (unprivileged user namespaces); this "
                             f"kernel refused them (network containment: {worker.NETWORK or 'none'})")
        _loopback_up()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        threading.Thread(target=_relay, args=(listener, path), daemon=True).start()
        _OPEN[path] = listener.getsockname()[1]
    return _OPEN[path]


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def _relay(listener: socket.socket, path: str) -> None:
    """One thread for every connection (a flood of requests costs sockets, not threads), never blocking on one of
    them: accept on the loopback, connect each to the Unix socket, copy bytes both ways through per-socket buffers
    until either side closes."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
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
            if sock is listener:
                client, _ = listener.accept()
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    upstream.connect(path)
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
