"""Each worker's output, relayed whole: a worker writes its stdout and stderr into a channel of its own, and this
process (the supervisor) writes them to its own stdout and stderr a whole line at a time, so that two ranks printing
at the same moment never merge into one line (with ``PYTHONUNBUFFERED=1``, ``print`` writes its text and its newline
in two writes, and another rank's line can fall between them).

A channel is a pseudo-terminal where this process's stream is a terminal (a rank sees a terminal as it would
without the relay: ``isatty()``, the width for a progress bar, colours) and a pipe otherwise. A progress bar's
``\\r`` ends a piece as a newline does; a line still open when its rank's channel closes (a rank that died mid-line)
is written with a newline added. ``prefix`` begins each piece with the global rank, as torchrun's ``--tee`` does
(``[rank1]:``). The channels stay readable after a rank died: the last lines of a rank killed in C++ (NCCL's
watchdog) still reach the terminal. Torch-free."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import selectors
import termios
import threading
import time
import tty
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

_ENDS = (b"\n", b"\r")
_READ = 1 << 16
TAIL_LINES = 40  # the lines of each rank's stderr kept for its report: a C++ abort leaves no failure file


@dataclass
class _Channel:
    rank: int
    out: int  # this process's fd it goes to: 1 or 2
    read: int  # this process's end
    write: Connection | None  # the worker's end, closed here once the worker has it
    pending: bytearray = field(default_factory=bytearray)  # a line not ended yet
    tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))  # its last lines
    closed_at: float | None = None  # time.time() when its worker's side closed: the worker's end, near enough


def _open(out: int) -> tuple[int, int]:
    """(read end, write end): a pseudo-terminal in raw mode (no ``\\r`` added to a newline: the real terminal adds
    it) with the real one's size where ``out`` is a terminal, else a pipe."""
    if not os.isatty(out):
        return os.pipe()
    read, write = os.openpty()
    tty.setraw(write)
    with contextlib.suppress(OSError):
        fcntl.ioctl(write, termios.TIOCSWINSZ, fcntl.ioctl(out, termios.TIOCGWINSZ, bytes(8)))
    return read, write


class Relay:
    """The channels of one attempt's ``ranks`` (global ranks, by local rank), read by a thread until each closes."""

    def __init__(self, ranks: range, prefix: bool = False) -> None:
        self.prefix = prefix
        self.channels: list[list[_Channel]] = []
        self.selector = selectors.DefaultSelector()
        self.stopping = False
        for rank in ranks:
            pair = []
            for out in (1, 2):
                read, write = _open(out)
                os.set_blocking(read, False)
                channel = _Channel(rank, out, read, Connection(write, readable=False))
                self.selector.register(read, selectors.EVENT_READ, channel)
                pair.append(channel)
            self.channels.append(pair)
        self.open = sum(len(pair) for pair in self.channels)
        self.thread = threading.Thread(target=self._run, name="ignite-mgpu-relay", daemon=True)
        self.thread.start()

    def ends(self, local_rank: int) -> tuple[Connection, Connection]:
        """The worker's ends of its stdout and stderr channels, to pass to it (multiprocessing passes a
        ``Connection``'s descriptor to a spawned or served worker); ``worker.take_output`` makes them its own."""
        out, err = self.channels[local_rank]
        assert out.write is not None and err.write is not None
        return out.write, err.write

    def started(self, local_rank: int) -> None:
        """The worker has its ends: this process closes its own copy, so that a channel ends with its worker."""
        for channel in self.channels[local_rank]:
            if channel.write is not None:
                channel.write.close()
                channel.write = None

    def last_words(self, local_rank: int) -> tuple[list[str], float | None]:
        """The last lines that worker ``local_rank`` wrote to stderr (all of them once the relay closed), and when
        its side of the channel closed (None: still open)."""
        err = self.channels[local_rank][1]
        lines = [*err.tail, *([bytes(err.pending)] if err.pending else [])]
        return [line.decode(errors="replace").rstrip("\r\n") for line in lines], err.closed_at

    def close(self, wait: float) -> None:
        """Relay what the workers wrote, for up to ``wait`` seconds after they ended (a data-loader worker of a dead
        rank may still hold its channel); then write what is left, lines not ended included, and close."""
        for local_rank in range(len(self.channels)):
            self.started(local_rank)  # a worker never started: nothing comes
        self.thread.join(wait)
        self.stopping = True
        self.thread.join()
        for pair in self.channels:
            for channel in pair:
                if channel.read >= 0:
                    self._end(channel)
        self.selector.close()

    def _run(self) -> None:
        while self.open and not self.stopping:
            for key, _ in self.selector.select(timeout=0.1):
                channel: _Channel = key.data
                try:
                    data = os.read(channel.read, _READ)
                except BlockingIOError:
                    continue
                except OSError as err:  # EIO: a pseudo-terminal whose worker side is closed
                    if err.errno != errno.EIO:
                        raise
                    data = b""
                if data:
                    self._take(channel, data)
                else:
                    self._end(channel)

    def _take(self, channel: _Channel, data: bytes) -> None:
        channel.pending += data
        last = max(channel.pending.rfind(end) for end in _ENDS)
        if last >= 0:
            whole = bytes(channel.pending[: last + 1])
            del channel.pending[: last + 1]
            self._write(channel, whole)
            if channel.out == 2:
                channel.tail.extend(whole.splitlines(keepends=True)[-TAIL_LINES:])

    def _end(self, channel: _Channel) -> None:
        """The channel closed: what it holds, a line not ended with its newline, and no more reading."""
        with contextlib.suppress(OSError):
            while data := os.read(channel.read, _READ):
                channel.pending += data
        if channel.pending:
            rest = bytes(channel.pending) + (b"" if channel.pending.endswith(_ENDS) else b"\n")
            channel.pending.clear()
            self._take(channel, rest)
        channel.closed_at = channel.closed_at or time.time()
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(channel.read)
        os.close(channel.read)
        channel.read = -1
        self.open -= 1

    def _write(self, channel: _Channel, data: bytes) -> None:
        if self.prefix:
            tag = f"[rank{channel.rank}]:".encode()
            data = b"".join(tag + piece for piece in data.splitlines(keepends=True))  # \n, \r or \r\n
        view = memoryview(data)
        # A closed terminal or pipe (`| head`): the rest is dropped, the workers go on.
        with contextlib.suppress(OSError):
            while view:
                view = view[os.write(channel.out, view) :]
