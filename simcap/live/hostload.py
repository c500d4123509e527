"""Who else used the CPU during a live run: detect runs disturbed by foreign processes.

On a small shared machine a live run competes with whatever else runs there; such a run
measures the disturbance, not the server. :class:`CpuWatch` reads ``/proc/stat`` and every
``/proc/[pid]/stat`` at the start and end of a run (no psutil) and splits the CPU time into:

- ``measured_cpu_s``: the load generator (this process and its descendants) and the server:
  the given PIDs, else the vLLM API server listening on the given port, else every process
  whose command line or name mentions vLLM; each with its descendants;
- ``foreign_cpu_s``: every other process (those started during the run count in full);
- ``unattributed_cpu_s``: busy time no live process accounts for (interrupts, processes that
  exited during the run without being waited for by a live parent);

- ``steal_s``: time the hypervisor gave to other guests (a VM's invisible neighbour).

``server_own_group``: whether a server process sits in another scheduling group than this
process (Linux groups tasks by session, ``/proc/PID/autogroup``: a session's own group, or the
default group of sessions that never made one; None where it does not or no server process was
found). Between groups, a spinning vLLM engine core can hold the load
generator on a shared core for up to a second at a time (``simcap/live/README.md``).

Exited children that their parent waited for count towards the parent (``cutime``), less the
CPU time they had used before the run began (a long build job reaped during a short run would
otherwise count its whole life). A process that was already running when the watch started but
was not seen then (its ``/proc`` entry unreadable at that moment) has no baseline: it counts
nothing, rather than its whole life.

A run is ``disturbed`` when foreign processes or steal used more than ``threshold_cores`` of a
core on average. Without ``/proc`` (not Linux) the watch reports ``available: False``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Iterable

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
DEFAULT_THRESHOLD_CORES = 0.10
SERVER_MARKERS = ("vllm", "VLLM")


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return None


def _system_times() -> dict[str, float] | None:
    text = _read("/proc/stat")
    if not text:
        return None
    fields = text.splitlines()[0].split()[1:]
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    vals = [int(v) / _TICK for v in fields[: len(names)]]
    return dict(zip(names, vals + [0.0] * (len(names) - len(vals))))


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    cpu_s: float
    start: int  # start time in ticks since boot: tells a reused PID apart
    name: str


def _processes() -> dict[int, _Proc]:
    procs: dict[int, _Proc] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return procs
    for entry in entries:
        if not entry.isdigit():
            continue
        text = _read(f"/proc/{entry}/stat")
        if not text:
            continue
        lpar, rpar = text.find("("), text.rfind(")")
        rest = text[rpar + 2 :].split()
        try:
            ppid, start = int(rest[1]), int(rest[19])
            # utime + stime, plus cutime + cstime: children that exited and were waited for
            # count towards their parent (a test's short-lived subprocesses, a build's jobs).
            ticks = sum(int(v) for v in rest[11:15])
        except (IndexError, ValueError):
            continue
        pid = int(entry)
        procs[pid] = _Proc(pid, ppid, ticks / _TICK, start, text[lpar + 1 : rpar])
    return procs


def _uptime_ticks() -> float | None:
    """Seconds since boot, in clock ticks (the unit of a process's start time)."""
    text = _read("/proc/uptime")
    try:
        return float(text.split()[0]) * _TICK if text else None
    except (IndexError, ValueError):
        return None


def cpu_used(
    before: dict[int, _Proc], after: dict[int, _Proc], started_ticks: float | None
) -> dict[int, float]:
    """CPU seconds each process alive at the end used between the two readings.

    A process seen at both readings used the difference. One first seen at the end used its
    whole life if it started after ``started_ticks`` (ticks since boot when ``before`` was
    read), else nothing is known of it and it counts 0. A parent that reaped a child during the
    run finds the child's whole life in its ``cutime``; the part the child had used before the
    run (its ``before`` reading) is taken back off the parent.
    """
    used: dict[int, float] = {}
    for pid, p in after.items():
        old = before.get(pid)
        if old is not None and old.start == p.start:
            used[pid] = p.cpu_s - old.cpu_s
        elif started_ticks is None or p.start >= started_ticks - 1:  # (tick rounding)
            used[pid] = p.cpu_s
        else:
            used[pid] = 0.0
    for pid, old in before.items():
        now = after.get(pid)
        if now is not None and now.start == old.start:
            continue  # still running
        parent = before.get(old.ppid)
        if old.ppid in used and parent is not None and after[old.ppid].start == parent.start:
            used[old.ppid] = max(used[old.ppid] - old.cpu_s, 0.0)
    return used


def autogroup(pid: int | str) -> str | None:
    """The scheduling group ``pid`` runs in where Linux groups tasks by session: its session's
    group (e.g. ``/autogroup-92``), or ``/`` for the default group that sessions never made a
    group of their own share (the file is empty then); None where the kernel does not group by
    session or ``pid`` is gone."""
    if (_read("/proc/sys/kernel/sched_autogroup_enabled") or "").strip() != "1":
        return None
    text = _read(f"/proc/{pid}/autogroup")
    if text is None:
        return None
    return text.split()[0] if text.strip() else "/"


def _cmdline(pid: int) -> str:
    text = _read(f"/proc/{pid}/cmdline")
    return text.replace("\0", " ") if text else ""


def _measured(
    procs: dict[int, _Proc], roots: Iterable[int], find_server: bool, port: int | None
) -> set[int]:
    """``roots``, the server's processes when asked to find them, and all their descendants."""
    keep = {p for p in roots if p in procs}
    if find_server:
        for p in procs.values():
            cmd = _cmdline(p.pid)
            if port is not None:
                args = cmd.split()
                if "vllm" in cmd and any(
                    a == f"--port={port}" or (a == "--port" and args[i + 1 : i + 2] == [str(port)])
                    for i, a in enumerate(args)
                ):
                    keep.add(p.pid)
            elif any(m in p.name for m in SERVER_MARKERS) or "vllm" in cmd:
                keep.add(p.pid)
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    stack = list(keep)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in keep:
                keep.add(child)
                stack.append(child)
    return keep


class CpuWatch:
    """CPU time of foreign processes between :meth:`start` and :meth:`stop`."""

    def __init__(
        self,
        server_pids: Iterable[int] = (),
        threshold_cores: float = DEFAULT_THRESHOLD_CORES,
        server_port: int | None = None,
    ) -> None:
        """``server_pids``: the server's processes (their descendants count too); without
        them, the vLLM server on ``server_port`` (or, without a port, anything vLLM) is found
        by command line. This process and its descendants always count as measured."""
        self.server_pids = set(server_pids)
        self.find_server = not self.server_pids
        self.server_port = server_port
        self.threshold_cores = threshold_cores
        self._t0 = 0.0
        self._sys0: dict[str, float] | None = None
        self._procs0: dict[int, _Proc] = {}
        self._ticks0: float | None = None

    def start(self) -> "CpuWatch":
        self._t0 = time.monotonic()
        self._sys0 = _system_times()
        self._ticks0 = _uptime_ticks()
        self._procs0 = _processes()
        return self

    def stop(self) -> dict:
        wall = time.monotonic() - self._t0
        sys1 = _system_times()
        if self._sys0 is None or sys1 is None:
            return {"available": False, "note": "no /proc/stat: disturbance not measured", "disturbed": False}
        procs1 = _processes()
        # The server's processes (given, or found by port or name) and their descendants; then
        # with this process and its descendants, everything the run measures.
        server = _measured(procs1, self.server_pids, self.find_server, self.server_port)
        measured = server | _measured(procs1, [os.getpid()], False, None)
        measured_s = foreign_s = 0.0
        top: list[tuple[float, str]] = []
        # No process can have used more than every core for the whole run; more means a
        # reaped child whose life before the run went unseen (an orphan reaped by init).
        cap = wall * (os.cpu_count() or 1)
        for pid, used in cpu_used(self._procs0, procs1, self._ticks0).items():
            p = procs1[pid]
            used = min(used, cap)
            if pid in measured:
                measured_s += used
            else:
                foreign_s += used
                if used > 0:
                    top.append((used, f"{p.name}[{pid}]"))
        mine = autogroup("self")
        groups = {autogroup(p) for p in server - {os.getpid()}} - {None}
        busy_keys = ("user", "nice", "system", "irq", "softirq")
        busy = sum(sys1[k] - self._sys0[k] for k in busy_keys)
        steal = sys1["steal"] - self._sys0["steal"]
        foreign_cores = foreign_s / wall if wall > 0 else 0.0
        steal_cores = steal / wall if wall > 0 else 0.0
        top.sort(reverse=True)
        return {
            "available": True,
            "wall_s": wall,
            "cpus": os.cpu_count(),
            "busy_cpu_s": busy,
            "measured_cpu_s": measured_s,
            "foreign_cpu_s": foreign_s,
            "unattributed_cpu_s": max(busy - measured_s - foreign_s, 0.0),
            "steal_s": steal,
            "foreign_cores": foreign_cores,
            "steal_cores": steal_cores,
            "top_foreign": [f"{name} {s:.2f}s" for s, name in top[:5]],
            "threshold_cores": self.threshold_cores,
            "disturbed": foreign_cores > self.threshold_cores or steal_cores > self.threshold_cores,
            "server_own_group": None if mine is None or not groups else bool(groups - {mine}),
        }
