"""The fast path's clock and the SimPy versions it is tested against.

``Clock.timeout_at`` wakes a process at an exact float time. SimPy's public API cannot: every
timeout lands at ``now + delay``, and some times are the result of no such addition (below).
So the clock writes the heap entry SimPy's ``schedule`` writes, using SimPy internals
(``Environment._now``, ``_queue``, ``_eid``, ``Event._ok``, ``_value``); pyproject.toml pins
SimPy to the minor release those internals were read from, and these tests fail, with a
message naming the pin, when the installed SimPy is outside it or has changed them.
"""

from __future__ import annotations

import math
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import simpy

from simcap.simulation.fast_forward import Clock

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _parse(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_installed_simpy_is_within_the_pin():
    pin = re.search(r'"simpy>=([\d.]+),<([\d.]+)"', PYPROJECT.read_text())
    assert pin, "pyproject.toml: simpy must be pinned as simpy>=X,<Y (Clock uses its internals)"
    low, high = pin.groups()
    installed = version("simpy")
    assert _parse(low) <= _parse(installed) < _parse(high), (
        f"SimPy {installed} is outside the tested pin simpy>={low},<{high}: "
        "simcap.simulation.fast_forward.Clock.timeout_at relies on SimPy internals; check them "
        "(tests/test_clock.py) before widening the pin"
    )


def test_simpy_has_the_internals_the_clock_uses():
    env = simpy.Environment()
    event = env.timeout(0)  # a triggered event, as timeout_at makes one
    missing = [name for name, obj in [("Environment._now", env), ("Environment._queue", env),
                                      ("Environment._eid", env), ("Event._ok", event),
                                      ("Event._value", event)]
               if not hasattr(obj, name.split(".")[1])]
    assert not missing and hasattr(simpy.core, "NORMAL"), (
        f"SimPy {version('simpy')} lacks {missing or ['core.NORMAL']}: "
        "simcap.simulation.fast_forward.Clock.timeout_at cannot work with it"
    )


def test_timeout_at_lands_where_no_public_timeout_can():
    now, at = 2.0**-52, 2.0 + 2.0**-51
    # now + d jumps over `at` as d steps through the floats around at - now: no delay hits it.
    delays = [at - now]
    for direction in (math.inf, -math.inf):
        d = at - now
        for _ in range(8):
            d = math.nextafter(d, direction)
            delays.append(d)
    assert all(now + d != at for d in delays)

    env = Clock()
    woke = []

    def proc():
        yield env.timeout(now)
        assert env.now == now
        yield env.timeout_at(at)
        woke.append(env.now)

    env.process(proc())
    env.run()
    assert woke == [at]


def test_timeout_at_refuses_the_past():
    env = Clock()
    env.run(until=1.0)
    with pytest.raises(ValueError, match="past"):
        env.timeout_at(0.5)
