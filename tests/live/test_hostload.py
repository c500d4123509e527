"""Disturbance detection: CPU time of foreign processes during a run (no server needed)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from simcap.live.hostload import CpuWatch, autogroup

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def test_foreign_and_own_cpu_are_told_apart():
    watch = CpuWatch(server_pids=[], server_port=1).start()
    # Our own child (waited for): measured. An orphan (its parent shell exits at once): foreign.
    subprocess.run([sys.executable, "-c", BUSY.format(s=0.5)], check=True)
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{BUSY.format(s=0.6)}' >/dev/null 2>&1 &"], check=True)
    time.sleep(0.2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # let the orphan burn its CPU second (cores are shared)
        time.sleep(0.3)
        out = watch.stop()
        if out["foreign_cpu_s"] >= 0.5:
            break
    assert out["available"]
    assert out["measured_cpu_s"] >= 0.45  # the waited-for child's CPU counts as ours
    assert out["foreign_cpu_s"] >= 0.5
    assert out["foreign_cores"] == pytest.approx(out["foreign_cpu_s"] / out["wall_s"])
    assert out["disturbed"] is (out["foreign_cores"] > out["threshold_cores"] or out["steal_cores"] > out["threshold_cores"])


def test_quiet_threshold_logic():
    out = CpuWatch(server_pids=[1], threshold_cores=1e9).start().stop()
    assert out["available"] and out["disturbed"] is False


def _proc(pid, ppid, cpu_s, start, name="p"):
    from simcap.live.hostload import _Proc

    return _Proc(pid, ppid, cpu_s, start, name)


def test_cpu_used_hand_cases():
    from simcap.live.hostload import cpu_used

    before = {
        10: _proc(10, 1, 5.0, 100),     # runs throughout: 5 -> 7.5 s
        11: _proc(11, 10, 100.0, 200),  # a long job with 100 s behind it, reaped by 10 in the run
        12: _proc(12, 1, 3.0, 300),     # exits unreaped by anyone alive: nothing to take back
    }
    after = {
        10: _proc(10, 1, 5.0 + 2.5 + 100.0 + 0.5, 100),  # own 2.5 s + the reaped job's life (100 + 0.5)
        20: _proc(20, 10, 4.0, 5000),   # started during the run (watch started at tick 4000)
        21: _proc(21, 1, 900.0, 50),    # running before the watch started, unseen then
        30: _proc(30, 1, 1.0, 7000, "reused pid"),
    }
    used = cpu_used(before, after, started_ticks=4000)
    assert used[10] == 2.5 + 0.5  # the reaped job's 0.5 s in the run, not its 100 s before it
    assert used[20] == 4.0
    assert used[21] == 0.0
    assert used[30] == 1.0
    assert set(used) == set(after)
    # A PID reused by a new process is a new process, and the old one exited.
    reused = {10: _proc(10, 1, 0.25, 9000)}
    assert cpu_used({10: _proc(10, 1, 50.0, 100)}, reused, started_ticks=8000) == {10: 0.25}
    # Without an uptime reading, an unseen process counts in full (the old behaviour).
    assert cpu_used({}, {21: _proc(21, 1, 9.0, 50)}, started_ticks=None) == {21: 9.0}


def test_a_server_in_a_session_of_its_own_is_named():
    """A server in another session sits in another scheduling group where Linux groups tasks
    by session; one in ours does not (simcap.live.server starts it so)."""
    if autogroup("self") is None:
        pytest.skip("this kernel does not group tasks by session")
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    own = subprocess.Popen(sleep, start_new_session=True)
    ours = subprocess.Popen(sleep, process_group=0) if sys.version_info >= (3, 11) else None
    try:
        assert CpuWatch(server_pids=[own.pid]).start().stop()["server_own_group"] is True
        if ours is not None:
            assert CpuWatch(server_pids=[ours.pid]).start().stop()["server_own_group"] is False
        assert CpuWatch(server_pids=[], server_port=1).start().stop()["server_own_group"] is None  # none found
    finally:
        for p in (own, ours):
            if p is not None:
                p.kill()
                p.wait()


def test_autogroup_reads_the_session_group_the_default_group_and_no_grouping(monkeypatch):
    """A session's own group by name; an empty file is the default group (a process whose
    session never made a group of its own, as under some service managers); no grouping where
    the kernel has it off or the process is gone."""
    from simcap.live import hostload

    files = {"/proc/sys/kernel/sched_autogroup_enabled": "1\n", "/proc/7/autogroup": "/autogroup-92 nice 0\n",
             "/proc/8/autogroup": ""}
    monkeypatch.setattr(hostload, "_read", files.get)
    assert [autogroup(7), autogroup(8), autogroup(9)] == ["/autogroup-92", "/", None]
    files["/proc/sys/kernel/sched_autogroup_enabled"] = "0\n"
    assert autogroup(7) is None
