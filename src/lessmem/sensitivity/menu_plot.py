"""Heat maps of a menu measurement: per item x option, the whole-gradient error (log scale), one
panel for layer inputs (conv, token linear) and one for the storages of BatchNorm / activation inputs
and saved-tensor regions (blank where an item was not measured with an option). A norm_conv item
shows as its conv (options with the BatchNorm exact, and ``from_bn`` with each BatchNorm storage)
and its BatchNorm (storages with the conv exact)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lessmem.core import FROM_NORM
from lessmem.sensitivity.items import JOINT_KIND, MAP_KINDS, MenuItem, split_joint


def plot_menu(menu_items: Sequence[MenuItem], path: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for item in menu_items for row in _rows(item)]  # (name, in the layer panel, option -> error)
    panels = [[r for r in rows if r[1]], [r for r in rows if not r[1]]]
    labels = ["layer input: kernel / storage", "input storage"]
    labels = [label for label, p in zip(labels, panels, strict=True) if p]
    panels = [p for p in panels if p]
    columns = [list(dict.fromkeys(o for r in p for o in r[2])) for p in panels]
    widths = [len(c) for c in columns]
    height = 1.6 + 0.28 * max(len(p) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(2.5 + 0.42 * sum(widths), height), squeeze=False,
                             gridspec_kw={"width_ratios": widths, "wspace": 0.3})
    floor = 1e-8  # exact options (error 0) drawn at the floor
    for ax, panel, options, label in zip(axes[0], panels, columns, labels, strict=True):
        grid = np.array([[max(errors[o], floor) if o in errors else np.nan for o in options] for _, _, errors in panel])
        im = ax.imshow(np.log10(grid), cmap="magma_r", vmin=math.log10(floor), vmax=0.0, aspect="auto")
        ax.set_xticks(range(len(options)), options, rotation=90, fontsize=7)
        ax.set_yticks(range(len(panel)), [name for name, _, _ in panel], fontsize=7)
        ax.set_xlabel(label, fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="log10 whole-gradient relative error")
    fig.suptitle(title, fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _rows(item: MenuItem) -> list[tuple[str, bool, dict[str, float]]]:
    errors = dict(zip(item.options, item.mean("grad_error"), strict=True))
    if item.kind != JOINT_KIND:
        return [(item.name, item.kind in MAP_KINDS, errors)]
    conv: dict[str, float] = {}
    norm: dict[str, float] = {}
    for option, error in errors.items():
        storage, conv_option = split_joint(option)
        if conv_option == FROM_NORM:
            conv[f"{FROM_NORM} ({storage})"] = error
        elif storage == "native":
            conv[conv_option] = error
        if conv_option == "1":
            norm[storage] = error
    return [(item.name, True, conv), (str(item.partner), False, norm)]
