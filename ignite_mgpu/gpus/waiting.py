"""The line of jobs waiting for GPUs (``--wait``), in the claims folder beside the claims: a ticket file per waiting
job, ``wait-<start ns>-<pid>-<uid>``, holding what it waits for (GPU names, or any ``count`` GPUs), flocked while
it waits. Jobs start in the order they began waiting (``acquire.py``), and an elastic job reads the whole line to
lend GPUs to it (``lending.py``). As in ``claims.py``, nothing read here is trusted. Torch-free."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass

from ignite_mgpu.gpus import shared_dir
from ignite_mgpu.gpus.claims import command_line, unwritable
from ignite_mgpu.gpus.holders import Holder, claim_names
from ignite_mgpu.gpus.shared_dir import printable
from ignite_mgpu.text import user_name

_TICKET = re.compile(r"wait-(\d{1,20})-(\d{1,10})-(\d{1,10})")  # wait-<start ns>-<pid>-<uid>
MAX_COUNT = 4096  # a ticket asking for more GPUs than this is garbage


@dataclass(frozen=True)
class Waiter:
    """One job in line: who, the GPUs it waits for (claim names; None: any ``count`` of them), and its place."""

    who: Holder
    wants: list[str] | None
    count: int = 1
    order: tuple[int, int] = (0, 0)  # (start ns, pid): earlier first


def waiting(dir_fd: int, before: tuple[int, int] | None = None) -> list[Waiter]:
    """The live tickets in line order (only those before ``before`` when given): dead, forged or garbled ones
    hold no place."""
    found = []
    for entry in shared_dir.entries(dir_fd, _TICKET.fullmatch):
        m = _TICKET.fullmatch(entry)
        if not m or (before is not None and (int(m[1]), int(m[2])) >= before):
            continue
        data = shared_dir.read_live(dir_fd, entry, int(m[3]))
        wants = None if data is None else data.get("wants", False)
        if data is None or not (wants is None or claim_names(wants)):
            continue
        count = data.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
            count = 1
        who = Holder(user_name(int(m[3])), int(m[2]), printable(str(data.get("command", ""))), int(m[1]) / 1e9, True)
        wanted = None if wants is None else list(wants)
        found.append(Waiter(who, wanted, len(wanted) if wanted is not None else count, (int(m[1]), int(m[2]))))
    return sorted(found, key=lambda w: w.order)


class Ticket:
    """A waiting job's place in the queue: ``wait-<start ns>-<pid>-<uid>`` holding what it waits for (GPU names,
    or null and a count for any), flocked while it waits. Jobs start in the order they began waiting: a job lets an
    earlier, still waiting one go first onto the GPUs that one named, and onto every GPU when it takes any (auto)."""

    def __init__(self, dir_fd: int, wants: list[str] | None, count: int = 1) -> None:
        self.dir_fd, self.fd = dir_fd, None
        self.name = f"wait-{time.time_ns()}-{os.getpid()}-{os.geteuid()}"
        # Written under a private name, then renamed: no reader ever sees it unlocked (stale) or half written.
        temporary = f"tmp-{self.name}"
        record = {"wants": wants, "count": count, "command": command_line()}
        try:
            fd = shared_dir.write_own(dir_fd, temporary, json.dumps(record).encode())
        except OSError as err:  # a wait without a place in line would wait forever
            raise unwritable(err) from None
        if fd is not None:
            try:
                os.rename(temporary, self.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                self.fd = fd
            except OSError:
                os.close(fd)
        self._remove_stale()

    def _remove_stale(self) -> None:
        """Tickets of this user's waits that ended without removing theirs (killed): unlocked, so dead."""
        for entry in shared_dir.entries(self.dir_fd, lambda n: _TICKET.fullmatch(n.removeprefix("tmp-"))):
            m = _TICKET.fullmatch(entry.removeprefix("tmp-"))  # tmp-: killed before it was renamed
            if not m or int(m[3]) != os.geteuid() or entry == self.name:
                continue
            opened = shared_dir.open_file(self.dir_fd, entry)
            if isinstance(opened, tuple):
                try:
                    if opened[1].st_uid == os.geteuid() and shared_dir.is_locked(opened[0]) is False:
                        os.unlink(entry, dir_fd=self.dir_fd)
                except OSError:
                    pass
                finally:
                    os.close(opened[0])

    def ahead(self) -> list[Waiter]:
        """The earlier tickets still waiting, in line order."""
        mine = _TICKET.fullmatch(self.name)
        assert mine is not None
        return waiting(self.dir_fd, before=(int(mine[1]), int(mine[2])))

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self.dir_fd)
            os.close(self.fd)
            self.fd = None
