"""Disturbance detection: CPU time of foreign processes during a run (no server needed)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from simcap.live.hostload import CpuWatch

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
