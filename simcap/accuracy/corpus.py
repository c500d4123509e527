"""The accuracy corpus: recorded real runs and published tables, each split into a fit part and
a held-out part.

A case is a folder with a ``case.json``. Two kinds:

- **live**: runs recorded against a real vLLM server (:mod:`simcap.live.recording`, one
  ``.run.json.gz`` per run: the client's records, ``/metrics`` before and after, the server's
  per-step log lines, the host load). ``fit`` names the runs of the calibration workload (the
  fit part) and the engine the server reported; each entry of ``points`` is one held-out
  workload: the scenario it was sent with, how its runs are replayed, and its runs, each with
  the server instance (a restart) that served it.
- **table**: published benchmark rows read through calibration recipes (one per step-time
  form); ``fit_rows`` are fitted, ``held_out`` rows predicted.

:class:`CaseRecorder` writes a live case as ``simcap live validate --record DIR`` runs: the
calibration workload on the first server instance when the case has no fit part yet, then
every validation run under the point's name, instance numbers continuing the case's own.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any, Literal, Sequence, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from simcap._version import __version__
from simcap.config.scenario import format_validation_error
from simcap.errors import SimcapError

CASE_FILE = "case.json"
FORMAT = "simcap accuracy case 1"
FORMS = ("linear", "roofline")
# The figures of a live point, each the median over its runs (simcap.live.validate.metric_value);
# with shared prefixes or sessions also prefix_hit_rate (hits over queries: the server's
# /metrics, the simulated engine's counters), with sessions later_turns_ttft_p50 (turns 2, 3, ...),
# and where the server preempted, preemptions (per run: its vllm:num_preemptions increment).
LIVE_METRICS = ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "itl_p50", "itl_p95", "e2e_p50", "e2e_p95",
                "output_throughput")


class CorpusError(SimcapError):
    """A case folder that cannot be read or recorded into (one line)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunRef(_Model):
    file: str  # relative to the case folder
    instance: int  # the server instance (restart) that served it


class LiveFit(_Model):
    runs: list[str]  # the calibration workload's recorded runs, in order
    engine: dict[str, Any]  # the engine section the calibration fitted with (the server's cache shape)
    speculative_method: str | None = None
    # The roofline form's catalog names or inline entries (hardware, model, ...); absent: linear only.
    roofline: dict[str, Any] | None = None


class LivePoint(_Model):
    name: str
    scenario: dict[str, Any]  # the scenario the runs were sent with (workload, engine, speculative)
    replay: Literal["closed", "times", "sessions"]
    runs: list[RunRef]
    # Sent at this fraction of each server instance's measured saturation rate, the scenario's
    # arrival rate replaced (simcap.live.saturation; each run's requested_rate and notes say which).
    rate_of_saturation: float | None = None


class TableRow(_Model):
    row: str  # a benchmark row's label (BenchmarkPoint.label)
    metrics: list[str]


class _Case(_Model):
    format: Literal["simcap accuracy case 1"]
    name: str
    description: str
    mechanisms: list[str]
    source: dict[str, Any]  # where the data came from: command, machine, server, versions
    _dir: Path = PrivateAttr(default=Path("."))

    @property
    def dir(self) -> Path:
        return self._dir


class LiveCase(_Case):
    kind: Literal["live"]
    fit: LiveFit
    points: list[LivePoint]

    @property
    def forms(self) -> tuple[str, ...]:
        return FORMS if self.fit.roofline else FORMS[:1]


class TableCase(_Case):
    kind: Literal["table"]
    recipes: dict[Literal["linear", "roofline"], str]  # form -> recipe file, relative to the case folder
    fit_rows: list[str]
    held_out: list[TableRow]

    @property
    def forms(self) -> tuple[str, ...]:
        return tuple(f for f in FORMS if f in self.recipes)


Case = Union[LiveCase, TableCase]


def parse_case(data: Any, folder: Path) -> Case:
    where = folder / CASE_FILE
    if not isinstance(data, dict):
        raise CorpusError(f"{where}: expected a JSON object")
    kind = data.get("kind")
    model = {"live": LiveCase, "table": TableCase}.get(kind)  # type: ignore[arg-type]
    if model is None:
        raise CorpusError(f"{where}: kind: must be live or table (got {kind!r})")
    try:
        case = model.model_validate(data)
    except ValidationError as exc:
        raise CorpusError(f"{where}: {format_validation_error(exc)}") from None
    case._dir = folder
    return case


def load_case(folder: str | Path) -> Case:
    folder = Path(folder)
    try:
        data = json.loads((folder / CASE_FILE).read_text())
    except OSError as exc:
        raise CorpusError(f"{folder / CASE_FILE}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CorpusError(f"{folder / CASE_FILE}: not JSON ({exc})") from None
    return parse_case(data, folder)


def load_corpus(root: str | Path, names: Sequence[str] = ()) -> list[Case]:
    """Every case under ``root`` (folders with a ``case.json``), by name; ``names`` picks some."""
    root = Path(root)
    if not root.is_dir():
        raise CorpusError(f"{root}: no such corpus folder")
    cases = [load_case(p.parent) for p in sorted(root.glob(f"*/{CASE_FILE}"))]
    if names:
        known = {c.name for c in cases}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise CorpusError(f"--case: no case named {', '.join(unknown)} in {root} "
                              f"(cases: {', '.join(sorted(known)) or 'none'})")
        cases = [c for c in cases if c.name in names]
    if not cases:
        raise CorpusError(f"{root}: no case folders (each holds a {CASE_FILE})")
    return cases


def write_case(folder: Path, data: dict[str, Any]) -> Case:
    """Validate and write ``case.json`` (sorted keys, one stable text)."""
    case = parse_case(data, folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CASE_FILE).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return case


def roofline_ref(hardware: str, model: str) -> dict[str, Any]:
    """A case's roofline form: ``hardware`` a catalog name or a YAML file holding one hardware
    entry (``benchmarks/measure_cpu.py`` writes one; kept inline, so the case needs no file),
    ``model`` a catalog model shape; combined by max (the live roofline test's form)."""
    import yaml

    entry: Any = hardware
    if Path(hardware).suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(Path(hardware).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise CorpusError(f"--roofline-hardware {hardware}: cannot read: {exc}") from None
        if not isinstance(data, dict) or len(data) != 1:
            raise CorpusError(f"--roofline-hardware {hardware}: expected one hardware entry (name: {{...}})")
        entry = next(iter(data.values()))
    return {"hardware": entry, "model": model, "combine": "max"}


class CaseRecorder:
    """Records a live case while ``simcap live validate --record DIR`` runs (its two hooks).

    ``on_instance``: on the first server instance of a case that has no fit part yet, runs
    the calibration workload on its (first) server (:func:`simcap.live.calibration.calibrate_live` with the
    server's log, at most ``calibrate_up_to`` clients) and keeps its runs as the fit part.
    ``on_run``: saves each validation run under the point, with its instance number counted
    on from the instances the point already holds (so a second command adds instances).
    """

    def __init__(self, folder: str | Path, scenario: Any, point: str, replay: str, *,
                 model: str | None, description: str | None = None, mechanisms: Sequence[str] = (),
                 server: dict[str, Any] | None = None, roofline: dict[str, Any] | None = None,
                 calibrate_up_to: int | None = None, api_key: str | None = None,
                 prompt_period: int | None = None, rate_of_saturation: float | None = None) -> None:
        from simcap.live.machine import cpu_info

        self.folder = Path(folder)
        self.point, self.replay, self.model = point, replay, model
        self.rate_of_saturation = rate_of_saturation
        self.api_key, self.prompt_period, self.calibrate_up_to = api_key, prompt_period, calibrate_up_to
        # The point's scenario as sent, less its step-time model (the replay fits its own).
        scenario = scenario.model_dump(mode="json", exclude_none=True)
        scenario.pop("profile", None)
        scenario.pop("step_time", None)
        self.scenario = scenario
        existing = (self.folder / CASE_FILE).exists()
        if existing:
            case = load_case(self.folder)
            if not isinstance(case, LiveCase):
                raise CorpusError(f"--record {self.folder}: holds a {case.kind} case, not a live one")
            self.data = json.loads((self.folder / CASE_FILE).read_text())
        else:
            if any(self.folder.rglob("*.run.json.gz")) if self.folder.is_dir() else False:
                raise CorpusError(f"--record {self.folder}: holds recorded runs but no {CASE_FILE}; "
                                  "give a new folder or a case folder")
            self.data = {
                "format": FORMAT, "kind": "live", "name": self.folder.name,
                "description": description or f"recorded by simcap live validate --record ({point})",
                "mechanisms": list(mechanisms),
                "source": {"command": " ".join(shlex.quote(a) for a in ["simcap", *sys.argv[1:]]),
                           "simcap_version": __version__, "machine": cpu_info(), "server": server or {}},
                "fit": None, "points": [],
            }
        if roofline is not None and self.data.get("fit"):
            self.data["fit"]["roofline"] = roofline
        self.roofline = roofline
        entry = next((p for p in self.data["points"] if p["name"] == point), None)
        if entry is not None and (entry["scenario"] != scenario
                                  or entry.get("rate_of_saturation") != rate_of_saturation):
            raise CorpusError(f"--point {point}: the case already holds this point with another "
                              "scenario or --rate-of-saturation; name the new one with --point")
        self.first_instance = 1 + max((r["instance"] for r in (entry or {}).get("runs", [])), default=-1)

    def on_instance(self, instance: int, base_urls: list[str], logs: list[Path]) -> None:
        if self.data.get("fit") or instance:
            return
        from simcap.live.calibration import calibrate_live

        if not logs:
            raise CorpusError("--record: the fit part is calibrated from the server's log "
                              "(--launch, or --log FILE with each --base-url)")
        engine = self.scenario.get("engine") or {}
        spec = self.scenario.get("speculative") or {}
        fit_dir = self.folder / "fit"
        cal = calibrate_live(
            base_urls[0], self.model, fit_dir / "profile.yaml", log_path=logs[0],
            max_num_seqs=engine["max_num_seqs"], max_num_batched_tokens=engine["max_num_batched_tokens"],
            max_model_len=engine.get("max_model_len"), speculative_method=spec.get("method"),
            api_key=self.api_key, bootstrap=0, max_concurrency=self.calibrate_up_to,
            prompt_period=self.prompt_period, record=fit_dir,
        )
        # The case replays the fit from the runs; the profile fitted now is not kept.
        for name in ("profile.yaml", "profile.iterations.log"):
            (fit_dir / name).unlink(missing_ok=True)
        runs = sorted((p.relative_to(self.folder).as_posix() for p in fit_dir.glob("phase*.run.json.gz")),
                      key=lambda r: int(r.split("phase")[1].split(".")[0]))
        self.data["fit"] = {"runs": runs, "engine": cal.engine,
                            "speculative_method": (cal.speculative or {}).get("method"),
                            "roofline": self.roofline}
        self.data["source"]["server_version"] = cal.server.get("version")
        self._write()

    def on_run(self, done: Any) -> None:
        from simcap.live.recording import save_run

        instance = self.first_instance + done.instance
        rel = f"{self.point}/i{instance}r{done.index}"
        path = save_run(self.folder / rel, done.run, iterations=done.iterations, cpu=done.cpu)
        entry = next((p for p in self.data["points"] if p["name"] == self.point), None)
        if entry is None:
            entry = {"name": self.point, "scenario": self.scenario, "replay": self.replay, "runs": []}
            if self.rate_of_saturation is not None:
                entry["rate_of_saturation"] = self.rate_of_saturation
            self.data["points"].append(entry)
        entry["runs"].append({"file": path.relative_to(self.folder).as_posix(), "instance": instance})
        self._write()

    def _write(self) -> None:
        # (every run comes after the first instance's calibration: the fit part exists by then)
        write_case(self.folder, self.data)
