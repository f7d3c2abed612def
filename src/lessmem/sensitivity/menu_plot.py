"""Heat maps of a menu measurement: per item x option, the whole-gradient error (log scale), one
panel for layer inputs (conv, token linear) and one for the storages of BatchNorm / activation inputs
and saved-tensor regions (blank where an item was not measured with an option)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lessmem.sensitivity.items import MAP_KINDS, MenuItem


def plot_menu(menu_items: Sequence[MenuItem], path: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [[i for i in menu_items if i.kind in MAP_KINDS], [i for i in menu_items if i.kind not in MAP_KINDS]]
    panels = [p for p in panels if p]
    columns = [list(dict.fromkeys(o for i in p for o in i.options)) for p in panels]
    widths = [len(c) for c in columns]
    height = 1.6 + 0.28 * max(len(p) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(2.5 + 0.42 * sum(widths), height), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    floor = 1e-8  # exact options (error 0) drawn at the floor
    for ax, items, options in zip(axes[0], panels, columns, strict=True):
        grid = np.array([[max(item.mean("grad_error")[item.index(o)], floor) if o in item.options else np.nan
                          for o in options] for item in items])
        im = ax.imshow(np.log10(grid), cmap="magma_r", vmin=math.log10(floor), vmax=0.0, aspect="auto")
        ax.set_xticks(range(len(options)), options, rotation=90, fontsize=7)
        ax.set_yticks(range(len(items)), [i.name for i in items], fontsize=7)
        ax.set_xlabel("layer input: kernel / storage" if items[0].kind in MAP_KINDS else "input storage", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="log10 whole-gradient relative error")
    fig.suptitle(title, fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
