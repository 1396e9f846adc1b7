"""A slow link for a test's job: the job runs in a network namespace of its own, whose loopback (where gloo's sockets
between local processes go) a tc token bucket (tbf) holds to a rate; ``slow_loopback()`` is the prefix of its command,
or a skip where this machine does not allow it (unshare, ip or tc missing or not permitted; probed once)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

RATE = "1gbit"
# tbf drops a packet longer than its bucket, and a loopback packet is up to 64 KiB (lo's MTU, 65536): a 128 KiB bucket
# passes two, where a smaller one (32kbit = 4,000 bytes) drops every large packet and TCP stalls in retransmissions.
# 128 KiB at 1 Gbit/s is a 1 ms burst, under 1 % of a 16 MB all-reduce. The queue holds 50 ms of traffic at the rate
# (6 MB): TCP is paced by the rate, not by losses.
BURST, LATENCY = "128kb", "50ms"


def _setup(rate: str) -> str:
    """The shell line that brings the namespace's loopback up at ``rate``, then runs its arguments."""
    return f'ip link set lo up && tc qdisc add dev lo root tbf rate {rate} burst {BURST} latency {LATENCY} && exec "$@"'


@functools.cache
def _unshare() -> tuple[str, ...] | str:
    """unshare and its flags for a new network namespace (in a user namespace of its own when not root: ``-r`` maps
    this user to root there, which tc needs), or why none can be made here."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH"
    how = ("unshare", "-n" if os.geteuid() == 0 else "-rn")
    try:
        argv = [*how, "sh", "-c", _setup(RATE), "sh", "true"]
        probe = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"`{' '.join(how)}` failed: {e}"
    if probe.returncode != 0:
        said = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        return f"`{' '.join(how)}` with a tbf qdisc on its loopback is not permitted here: {said}"
    return how


def slow_loopback(rate: str = RATE) -> list[str]:
    """The prefix that runs a command in a fresh network namespace whose loopback carries ``rate`` (tc's units:
    1gbit); skips the calling test where this machine cannot make one."""
    how = _unshare()
    if isinstance(how, str):
        pytest.skip(f"no slow link: {how}")
    return [*how, "sh", "-c", _setup(rate), "sh"]
