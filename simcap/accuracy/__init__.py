"""How good simcap's predictions are, as a tested property.

The corpus (``calibration/corpus/``) holds recorded real runs and published tables, each case
split into a fit part and a held-out part (:mod:`simcap.accuracy.corpus`). A replay fits every
case on its fit part with the shipped calibration path and predicts its held-out part
(:mod:`simcap.accuracy.replay`); the errors make the accuracy table, and a recorded copy of
them is the ratchet every change is checked against (:mod:`simcap.accuracy.report`).
``simcap accuracy`` runs it; ``simcap live validate --record DIR`` adds a live case.
"""
