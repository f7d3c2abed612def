"""A model's whole-step peak as a function of a map's saved bytes, from a few measured steps.

Parameters, gradients, optimizer state and the batch do not depend on the map; what does is the
saved activations and the transients of backward. The peak is the largest of the step's moments,
each a constant plus the saved bytes still alive then: a convex, piecewise-linear function of the
saved bytes whose slope is the fraction of them alive at the peak (near 1 with much saved: the
peak is at the start of backward; near 0 at the floor: the peak moves late into backward, where
full-size gradients dominate). The profiler says that fraction at every measured step (the bytes it
files as activations at the peak), so each measured point gives a tangent; the prediction is the
largest tangent, capped by the chord between the measured points around it (what convexity
bounds it by). Each verified map adds a point, so the model gets exact where the budget search
looks. Other batch sizes scale the map-dependent part with the batch (``at_batch``)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class PeakModel:
    # (saved bytes, measured peak, fraction of the saved bytes alive at the peak)
    points: list[tuple[float, float, float]] = field(default_factory=list)
    static_bytes: float = 0.0  # parameters, gradients, optimizer state at the peak: batch-independent

    def add(self, saved: float, peak: float, live: float) -> None:
        """A measured step: ``live`` bytes of the map's ``saved`` were alive at its ``peak``."""
        slope = min(1.0, max(0.0, live / saved)) if saved > 0 else 0.0
        kept = {s: (p, f) for s, p, f in self.points}
        kept[float(saved)] = (float(peak), slope)
        self.points = [(s, p, f) for s, (p, f) in sorted(kept.items())]

    def predict(self, saved: float) -> float:
        """The whole-step peak of a map keeping ``saved`` bytes for backward."""
        if not self.points:
            raise ValueError("the peak model has no measured step")
        tangent = max(p + f * (saved - s) for s, p, f in self.points)
        xs = [s for s, _, _ in self.points]
        i = bisect.bisect_left(xs, saved)
        if i == 0 or i == len(xs):  # beyond the measured maps: the nearest point's tangent
            s, p, f = self.points[min(i, len(xs) - 1)]
            return p + f * (saved - s)
        (s0, p0, _), (s1, p1, _) = self.points[i - 1], self.points[i]
        chord = p0 + (p1 - p0) * (saved - s0) / (s1 - s0)
        return min(chord, max(tangent, p0))

    def saved_for(self, peak: float) -> float:
        """The most saved bytes whose predicted peak is ``peak`` (bisection on ``predict``)."""
        lo, hi = 0.0, max(s for s, _, _ in self.points) * 4 + 1
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.predict(mid) <= peak else (lo, mid)
        return lo

    def at_batch(self, scale: float) -> PeakModel:
        """This model for ``scale`` x the batch: saved bytes and the map-dependent part of the peak
        (everything above ``static_bytes``) grow with the batch; the fractions alive stay."""
        return PeakModel([(s * scale, self.static_bytes + (p - self.static_bytes) * scale, f)
                          for s, p, f in self.points], self.static_bytes)
