"""A server's saturation rate on a workload, measured where the workload runs:
``simcap live validate --rate-of-saturation F``.

An open-loop point "near saturation" is near it only when its rate comes from the server it
runs on. A fixed rate does not stay near: on a shared host the same server's speed moves by
1.0-1.6x between days, and a rate set one day can be past saturation the next (where TTFT
grows through the run with its length, not with the server's behaviour at that load).

The probe (:func:`measure_saturation`), run on each server instance after its warm-up:

- the point's request mix (its length distributions, a seed of its own) sent as a closed loop of
  ``2 x max_num_seqs`` clients: the engine's batch stays full and as many requests wait, as in
  an overloaded open loop, so the completions per second are the rate the server saturates at;
- ``PROBE_REQUESTS_PER_CLIENT`` requests per client; the rate is read between the
  ``clients``-th and the ``(n - clients)``-th completion (:func:`steady_completion_rate`),
  leaving out the first wave and the drain at the end, when fewer clients remain.

The point then runs at ``F x`` that rate (:func:`at_fraction`), every run of the instance; each
run's notes say which rate it was sent at and why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from simcap.config.scenario import ClosedArrival, GammaArrival, PoissonArrival, Scenario
from simcap.live.client import LiveError, run_live

# Requests per probe client: enough that the steady window holds most of the run.
PROBE_REQUESTS_PER_CLIENT = 6
# The largest fraction accepted: past 1, the point is past saturation by that factor.
MAX_FRACTION = 2.0


@dataclass(frozen=True)
class SaturationProbe:
    """One probe's result: the saturation rate (requests/s) and how it was measured."""

    rate: float
    clients: int
    requests: int
    completed: int
    window_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self, fraction: float) -> str:
        """The sentence a run's notes carry."""
        return (f"rate {fraction * self.rate:.3g} req/s: {fraction:g} x this server instance's saturation rate "
                f"{self.rate:.3g} req/s (closed loop of {self.clients} clients, {self.requests} requests; "
                f"{self.completed - 2 * self.clients} completions over {self.window_s:.1f} s after the first "
                f"{self.clients})")


def check_rate_of_saturation(scenario: Scenario, fraction: float | None, fleet: bool = False) -> None:
    """One-line errors for ``--rate-of-saturation`` on ``scenario``."""
    if fraction is None:
        return
    if not 0 < fraction <= MAX_FRACTION:
        raise LiveError(f"--rate-of-saturation: must be > 0 and at most {MAX_FRACTION:g} (got {fraction:g})")
    if fleet or scenario.deployment is not None:
        raise LiveError("--rate-of-saturation: probes one server; a fleet's rate is given in the scenario")
    wl = scenario.workload
    if not isinstance(wl.arrival, (PoissonArrival, GammaArrival)) or wl.sessions is not None:
        raise LiveError("--rate-of-saturation: sets an open-loop workload's rate (workload.arrival.process: "
                        f"poisson or gamma, no sessions); this one is {wl.arrival.process}"
                        + (" with sessions" if wl.sessions is not None else ""))
    if wl.num_requests is None:
        raise LiveError("--rate-of-saturation: the workload needs num_requests (its length follows from the rate)")


def steady_completion_rate(finish_times: Sequence[float], clients: int) -> tuple[float, int, float]:
    """(requests/s, completions counted, window in s) of a closed loop of ``clients`` clients:
    the completions after the ``clients``-th up to the ``(n - clients)``-th, over the time
    between those two. Raises :class:`LiveError` with fewer than ``2 x clients + 2`` finishes."""
    t = sorted(finish_times)
    n = len(t)
    if n < 2 * clients + 2:
        raise LiveError(f"saturation probe: {n} request(s) completed; at least {2 * clients + 2} are needed "
                        f"for a steady window with {clients} clients")
    lo, hi = clients - 1, n - clients - 1
    window = t[hi] - t[lo]
    if window <= 0:
        raise LiveError("saturation probe: its completions all ended at one instant; no rate can be read")
    return (hi - lo) / window, n, window


def probe_scenario(scenario: Scenario) -> Scenario:
    """The probe's workload: the point's request mix as a closed loop of ``2 x max_num_seqs``
    clients, :data:`PROBE_REQUESTS_PER_CLIENT` requests each, a seed of its own."""
    clients = 2 * scenario.engine.max_num_seqs
    wl = scenario.workload
    return scenario.model_copy(update={
        "seed": scenario.seed + 104729,
        "workload": wl.model_copy(update={
            "arrival": ClosedArrival(process="closed", concurrency=clients),
            "num_requests": clients * PROBE_REQUESTS_PER_CLIENT, "duration_s": None}),
    })


def measure_saturation(scenario: Scenario, base_url: str, model: str | None, endpoint: str,
                       **live_kwargs: Any) -> SaturationProbe:
    """Run the probe (see the module doc) against the server at ``base_url``."""
    probe = probe_scenario(scenario)
    run = run_live(probe, base_url, model, endpoint=endpoint, progress=False, **live_kwargs)  # type: ignore[arg-type]
    clients = probe.workload.arrival.concurrency  # type: ignore[union-attr]
    finished = [r.finish_time for r in run.records if r.succeeded and r.finish_time is not None]
    rate, completed, window = steady_completion_rate(finished, clients)
    return SaturationProbe(rate, clients, len(run.records), completed, window)


def at_fraction(scenario: Scenario, fraction: float, probe: SaturationProbe) -> Scenario:
    """``scenario`` with its open-loop rate set to ``fraction`` x the probe's rate."""
    arrival = scenario.workload.arrival.model_copy(update={"rate": fraction * probe.rate})
    return scenario.model_copy(update={"workload": scenario.workload.model_copy(update={"arrival": arrival})})
