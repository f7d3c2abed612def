"""A model's whole-step peak as a function of a map's saved bytes, from a few measured steps.

Parameters, gradients, optimizer state and the batch do not depend on the map; what does is the
saved activations and the transients of backward (gradients of activations in flight, a
compressed input expanded for its weight gradient), which grow with the saved bytes but not in
exact proportion: the peak is the largest of the step's moments, each a constant plus the saved
bytes alive then, a convex function of the saved bytes (slope 1 with much saved: the peak is at the
start of backward, where every saved byte is alive; flat near the floor, where the peak moves late
into backward). Between measured maps the peak is interpolated linearly in saved bytes (the chord,
above the curve by convexity), beyond them extrapolated along the nearest segment. ``fit``'s
profile measures a map near the bend (``bend``), so the chords follow the two slopes; each
verified map adds a point, so the model gets exact where the budget search looks. Other batch
sizes scale the map-dependent part with the batch (``at_batch``)."""

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
        xs = [s for s, _ in self.points]
        i = min(max(bisect.bisect_left(xs, saved), 1), len(xs) - 1)
        (s0, p0), (s1, p1) = self.points[i - 1], self.points[i]
        slope = (p1 - p0) / (s1 - s0)
        return p0 + slope * (saved - s0)

    def bend(self) -> float:
        """Saved bytes where a slope-1 line through the largest measured map meets the smallest
        one's peak: the bend of a peak that is the floor's below it and the start of backward's above."""
        floor_peak, (top_saved, top_peak) = self.points[0][1], self.points[-1]
        return top_saved - (top_peak - floor_peak)

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
