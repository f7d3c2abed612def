"""A model's whole-step peak as a function of a map's saved bytes, from a few measured steps.

Parameters, gradients, optimizer state and the batch do not depend on the map; what does is the
saved activations and the transients of backward (gradients of activations in flight, a
compressed input expanded for its weight gradient), which grow with the saved bytes but not in
exact proportion: the peak is the largest of the step's moments, each a constant plus the saved
bytes alive then, a convex function of the saved bytes (slope near 1 with much saved, flat near the
floor, where the peak moves late into backward). Between two measured maps convexity bounds the
peak above by their chord and below by the lower map's peak and the neighbouring segments
extended; the prediction is the middle of those bounds (the chord where no neighbour bounds it),
beyond the measured maps the nearest segment extended. ``fit``'s profile measures stock, the floor
and a map between, so a budget's target is interpolated, not extrapolated; each verified map adds a
point, so the model gets exact where the budget search looks. Other batch sizes scale the map-dependent part with the
batch (``at_batch``)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class PeakModel:
    points: list[tuple[float, float]] = field(default_factory=list)  # (saved bytes, measured peak)
    static_bytes: float = 0.0  # parameters, gradients, optimizer state at the peak: batch-independent

    def add(self, saved: float, peak: float) -> None:
        self.points = sorted({s: p for s, p in [*self.points, (float(saved), float(peak))]}.items())

    def predict(self, saved: float) -> float:
        """The whole-step peak of a map keeping ``saved`` bytes for backward."""
        if not self.points:
            raise ValueError("the peak model has no measured step")
        if len(self.points) == 1:  # one step: the saved bytes move the peak one for one
            s0, p0 = self.points[0]
            return p0 + saved - s0
        pts = self.points
        i = bisect.bisect_left([s for s, _ in pts], saved)
        if i == 0 or i == len(pts):  # beyond the measured maps: the nearest segment extended
            return _line(*(pts[:2] if i == 0 else pts[-2:]), saved)
        if pts[i][0] == saved:
            return pts[i][1]
        chord = _line(pts[i - 1], pts[i], saved)
        below = [_line(pts[j], pts[j + 1], saved) for j in (i - 2, i) if j >= 0 and j + 1 < len(pts)]
        if not below:
            return chord
        return (chord + min(chord, max(pts[i - 1][1], *below))) / 2

    def saved_for(self, peak: float) -> float:
        """The most saved bytes whose predicted peak is ``peak`` (bisection on ``predict``)."""
        lo, hi = 0.0, max(s for s, _ in self.points) * 4 + 1
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.predict(mid) <= peak else (lo, mid)
        return lo

    def at_batch(self, scale: float) -> PeakModel:
        """This model for ``scale`` x the batch: saved bytes and the map-dependent part of the peak
        (everything above ``static_bytes``) grow with the batch."""
        return PeakModel([(s * scale, self.static_bytes + (p - self.static_bytes) * scale)
                          for s, p in self.points], self.static_bytes)


def _line(a: tuple[float, float], b: tuple[float, float], x: float) -> float:
    """The line through ``a`` and ``b`` at ``x``."""
    return a[1] + (b[1] - a[1]) * (x - a[0]) / (b[0] - a[0])
