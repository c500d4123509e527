"""Replay accuracy-corpus cases with a regression planted in the engine, and print the ratchet.

    SIMCAP_INTERPRETED=1 python tests/accuracy_plants.py PLANT CASE [CASE ...]

Run by ``tests/test_accuracy.py`` in a subprocess: the engine's modules are interpreted there
(their compiled twins cannot be patched), the plant is applied to their classes, the cases are
replayed and the ratchet's lines (:func:`simcap.accuracy.report.ratchet`) printed as JSON.
Plant ``none`` patches nothing: the interpreted engine must hold the record as the compiled one does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _after_init(cls, change) -> None:
    original = cls.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        change(self)

    cls.__init__ = init


def plant(name: str) -> None:
    from simcap.engine import scheduler, step_time

    if name == "none":
        return
    if name == "host_overhead_dropped":  # a step-time term dropped: the host work between steps
        for cls in (step_time.StepTimeModel, step_time.RooflineStepTimeModel):
            _after_init(cls, lambda m: setattr(m, "host_overhead", 0.0))
    elif name == "max_num_seqs_halved":  # a scheduler rule broken: half the running slots
        _after_init(scheduler.Scheduler, lambda s: setattr(s, "max_num_seqs", max(1, s.max_num_seqs // 2)))
    elif name == "token_budget_doubled":  # a scheduler rule broken: twice the step token budget
        _after_init(scheduler.Scheduler, lambda s: setattr(s, "max_num_batched_tokens", 2 * s.max_num_batched_tokens))
    else:
        raise SystemExit(f"unknown plant {name!r}")


def main() -> None:
    name, cases = sys.argv[1], sys.argv[2:]
    from simcap.runtime import compiled

    if not compiled.summary().startswith("engine modules interpreted"):
        raise SystemExit("run with SIMCAP_INTERPRETED=1: " + compiled.summary())
    plant(name)
    from simcap.accuracy.corpus import load_corpus
    from simcap.accuracy.replay import replay_corpus
    from simcap.accuracy.report import ratchet, read_record

    corpus = ROOT / "calibration" / "corpus"
    replays = replay_corpus(load_corpus(corpus, cases))
    print(json.dumps(ratchet(replays, read_record(corpus.parent / "accuracy.json"))))


if __name__ == "__main__":
    assert os.environ.get("SIMCAP_INTERPRETED") == "1", "run with SIMCAP_INTERPRETED=1"
    main()
