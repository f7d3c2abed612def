"""What a larger batch costs under a memory budget: per batch size, the best map's predicted peak
and gradient error, from one ``budget_profile`` (menu bytes and the peak model scaled with the batch)."""

from __future__ import annotations

from dataclasses import dataclass

from lessmem.sensitivity.fit import AIM, BudgetProfile, largest_batch, scaled_menu, smallest_map
from lessmem.sensitivity.menu import DEFAULT_CRITERION


@dataclass
class PlanRow:
    batch_size: int
    fits: bool
    predicted_peak_bytes: float  # the best map's (the floor's when nothing fits)
    grad_error: float | None  # its whole-gradient error; None when nothing fits
    cosine: float | None
    reruns_step_ratio: float = 1.0  # its recomputed regions' predicted step over stock's (1: none)


def plan_batches(profile: BudgetProfile, budget_bytes: float, factors: tuple[float, ...] = (1, 1.5, 2, 3, 4, 6, 8),
                 criterion: str = DEFAULT_CRITERION, max_step_ratio: float = 1.0) -> list[PlanRow]:
    """Batch sizes from stock's largest within ``budget_bytes`` up to 8x it; regions recomputed as
    the menu predicts ``max_step_ratio`` allows (``lessmem.fit`` measures the chosen map's step)."""
    assert profile.menu is not None and profile.floor_map is not None
    stock_largest = max(1, largest_batch(profile.peaks, profile.menu.stock_bytes, profile.batch_size, budget_bytes))
    rows = []
    for batch in sorted({max(1, round(stock_largest * f)) for f in factors}):
        scale = batch / profile.batch_size
        peaks, menu = profile.peaks.at_batch(scale), scaled_menu(profile.menu, scale)
        floor = smallest_map(menu, criterion, max_step_ratio)
        if peaks.predict(floor.score["bytes"]) > budget_bytes:
            rows.append(PlanRow(batch, False, peaks.predict(floor.score["bytes"]), None, None))
            continue
        target = max(peaks.saved_for(AIM * budget_bytes), floor.score["bytes"])  # as fit() aims
        choice = menu.make_map(min(target, menu.stock_bytes), criterion, max_step_ratio=max_step_ratio)
        rows.append(PlanRow(batch, True, peaks.predict(choice.score["bytes"]), choice.score["grad_error"],
                            choice.score["cosine"], choice.score.get("step_ratio", 1.0)))
    return rows
