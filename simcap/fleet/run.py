"""Running a scenario, whatever it deploys: one engine, or replicas behind a router.

:func:`simulate` is ``simcap.simulate``: a scenario with a ``deployment`` runs as a fleet
(:func:`simcap.fleet.replicas.simulate_fleet`, a :class:`~simcap.fleet.replicas.FleetResult`),
any other as one engine (:func:`simcap.simulation.simulator.simulate_engine`, a
:class:`~simcap.simulation.simulator.Result`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from simcap.config.scenario import Scenario, check_limits
from simcap.simulation.early_stop import SloStop
from simcap.simulation.simulator import Result, simulate_engine
from simcap.workloads.requests import ClosedLoopTrace, RequestSpec

if TYPE_CHECKING:
    from simcap.fleet.replicas import FleetResult


def simulate(
    scenario: Scenario,
    trace: list[tuple[float, RequestSpec]] | ClosedLoopTrace | None = None,
    *,
    fast: bool = True,
    records: bool = False,
    steps: bool = False,
    stop: SloStop | None = None,
) -> Result | FleetResult:
    """Run one scenario to completion (every request finishes) and summarise it: its
    deployment's replicas on one clock, or one engine. The arguments are
    :func:`~simcap.simulation.simulator.simulate_engine`'s, for either kind.

    A scenario larger than one simulation holds (:func:`simcap.config.scenario.check_limits`)
    is a ScenarioError before anything is allocated.
    """
    if scenario.deployment is None:
        return simulate_engine(scenario, trace, fast=fast, records=records, steps=steps, stop=stop)
    check_limits(scenario, records=records or steps)
    from simcap.fleet.replicas import simulate_fleet  # (imported for a fleet only: a command's start)

    return simulate_fleet(scenario, trace, fast=fast, records=records, steps=steps, stop=stop)
