"""Standard output and error that never end a run. A pipe whose reader went away (`evenrl train ... | head`), a
descriptor closed at start (`>&-`) or a terminal that hung up is noted once on stderr (by the process that speaks
for the run: rank 0 or the launcher) and from then on that descriptor writes to /dev/null, so Python's writes, its
last flush at exit, C code and child processes all go on quietly while training does. Both streams also keep the
last lines written through them, which a worker of evenrl's launcher leaves beside its heartbeat
(evenrl.train.liveness): a rank that dies without a Python exception is explained by its last words.

`install()` runs first in every evenrl program (evenrl.cli.run), in each launcher worker (evenrl.cli.worker) and in
the launcher's fork server before it imports anything (evenrl.train.preload), so that loggers made while importing
hold the guarded streams."""

from __future__ import annotations

import collections
import errno
import os
import sys
import threading
from typing import Callable

TAIL_LINES = 12  # the last lines kept (both streams, in the order written)
_LINE_CHARS = 300  # of each: a progress bar's carriage-return updates, a long traceback line
_tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
_open_line = [""]  # text written after the last newline
_lock = threading.Lock()
listeners: list[Callable[[], None]] = []  # called after a write that ends a line (evenrl.train.liveness)
_speak = [True]  # note a broken stdout (a run); `evenrl plan | head` ends quietly, as command-line tools do


class GuardedStream:
    """sys.stdout or sys.stderr: writes and flushes go to the wrapped stream until it fails with an OSError (a
    broken pipe, a closed or hung-up descriptor); then once a note, the descriptor to /dev/null, and nothing
    raised. Everything else (fileno, isatty, encoding, ...) is the wrapped stream's."""

    def __init__(self, stream, fd: int, name: str):
        self._stream, self._fd, self._name, self._broken = stream, fd, name, False

    def write(self, text: str) -> int:
        _remember(text)
        if not self._broken:
            try:
                return self._stream.write(text)
            except OSError as e:
                self._break(e)
            except ValueError:  # closed by someone; an encoding error (also a ValueError) is not ours to hide
                if not self._stream.closed:
                    raise
                self._break(OSError(errno.EBADF, "closed"))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._broken:
            return
        try:
            self._stream.flush()
        except OSError as e:
            self._break(e)
        except ValueError:
            if not self._stream.closed:
                raise
            self._broken = True

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _break(self, error: OSError) -> None:
        self._broken = True
        _to_devnull(self._fd)
        try:  # what the stream still buffers now goes to /dev/null, so the interpreter's last flush cannot raise
            self._stream.flush()
        except (OSError, ValueError):
            pass
        why = {errno.EPIPE: "its reader went away (broken pipe)", errno.EBADF: "it is closed",
               errno.EIO: "its terminal hung up"}.get(error.errno, f"{error.__class__.__name__}: {error.strerror}")
        _note(f"evenrl: {self._name} is no longer writable: {why}; training goes on, its output to {self._name} "
              "is dropped (metrics, samples and checkpoints are in log.run_dir)")


def install(speak: bool = True) -> None:
    """Guard this process's stdout and stderr (once). A standard descriptor closed at start (`>&-`) is opened on
    /dev/null first, so that no file this process opens later lands on it and takes its output, and noted.
    speak=False: no note (a command whose output is all it does, not a run)."""
    _speak[0] = speak
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            _to_devnull(fd)
            if fd:
                setattr(sys, name, open(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                                        buffering=1))
                if fd == 1:  # stderr itself closed has nobody to tell
                    _note("evenrl: stdout was closed at start; training goes on, its output to stdout is dropped "
                          "(metrics, samples and checkpoints are in log.run_dir)")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, GuardedStream):
            setattr(sys, name, GuardedStream(stream, fd, name))


def tail() -> list[str]:
    """The last lines written to stdout and stderr through Python (each cut to its last 300 characters)."""
    with _lock:
        return list(_tail) + ([_open_line[0][-_LINE_CHARS:]] if _open_line[0].strip() else [])


def _remember(text: str) -> None:
    if not text:
        return
    with _lock:
        parts = (_open_line[0] + text).split("\n")
        _open_line[0] = parts.pop()[-4 * _LINE_CHARS:]
        for part in parts:
            line = part.rsplit("\r", 1)[-1].rstrip()  # a progress bar's last state, not each redraw
            if line:
                _tail.append(line[-_LINE_CHARS:])
    if len(parts) and listeners:
        for listener in listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001  (a listener's failure must not become the write's)
                pass


def _to_devnull(fd: int) -> None:
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def _note(line: str) -> None:
    """Once per process, from the process that speaks for the run (rank 0, the launcher, a lone process); written
    to descriptor 2 directly: the stream may be the broken one."""
    if os.environ.get("RANK", "0") != "0" or not _speak[0]:
        return
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass
