"""The calibration vocabulary: the step-time terms, :class:`Form` (which terms a fit may move),
:class:`CalibrationError`, the check of a count a user gave, and the rounding used for
coefficients written out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from simcap.engine.step_time import FEATURES
from simcap.errors import SimcapError


TERMS = FEATURES
# Typical magnitudes (s per unit), used to scale the optimiser's variables and as start values.
TYPICAL = {
    "base": 0.01,
    "per_prefill_token": 5e-5,
    "per_decode_token": 5e-4,
    "per_verify_token": 5e-4,
    "per_context_token": 1e-8,
    "mixed_step": 0.01,
    "draft_per_pass": 1e-3,
    "draft_per_request": 1e-4,
}


class CalibrationError(SimcapError):
    """Measurements that cannot be read or fitted; the message names the file and the problem."""


def is_whole(value: object, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool) in ``[low, high]``: a count a user gave."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _fmt(x: float) -> float:
    """A coefficient rounded to 6 significant digits (below 1e-12 s: 0), for readable YAML."""
    return 0.0 if abs(x) < 1e-12 else float(f"{x:.6g}")


@dataclass(frozen=True)
class Form:
    """Which step-time terms a fit may move: ``free`` ones, and ``tied`` ones (term -> free term)."""

    free: tuple[str, ...]
    tied: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | Sequence[str]) -> "Form":
        """``"base,per_decode_token,per_verify_token=per_decode_token"`` -> Form."""
        items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
        items = [t for t in items if t]
        free: list[str] = []
        tied: dict[str, str] = {}
        for item in items:
            name, sep, other = (s.strip() for s in item.partition("="))
            for term in (name, other) if sep else (name,):
                if term not in TERMS:
                    raise CalibrationError(
                        f"--form: unknown term {term!r}; allowed: {', '.join(TERMS)}"
                    )
            if sep:
                tied[name] = other
            elif name not in free:
                free.append(name)
        for name, other in tied.items():
            if other not in free:
                raise CalibrationError(f"--form: {name}={other} ties to a term that is not free")
            if name in free:
                raise CalibrationError(f"--form: {name} is both free and tied")
        if not free:
            raise CalibrationError("--form: no free term; name at least one of " + ", ".join(TERMS))
        return cls(tuple(free), tied)

    def __str__(self) -> str:
        return ",".join([*self.free, *(f"{a}={b}" for a, b in self.tied.items())])

    def ties(self, fixed: dict[str, float]) -> dict[str, str]:
        """Tied terms, with StepTimeConfig's rule: no verify cost of its own is the decode one's."""
        if (fixed.get("per_verify_token") is None and "per_verify_token" not in self.free
                and "per_verify_token" not in self.tied):
            return {"per_verify_token": "per_decode_token", **self.tied}
        return dict(self.tied)

    def coefficients(self, x: Sequence[float], fixed: dict[str, float]) -> dict[str, float]:
        """Full coefficient dict: free values from ``x``, tied copies, the rest from ``fixed``."""
        out = {t: float(fixed.get(t) or 0.0) for t in TERMS}
        for name, value in zip(self.free, x):
            out[name] = float(value)
        for name, other in self.ties(fixed).items():
            out[name] = out[other]
        return out
