"""Heat map of a sensitivity result: layers x kernels, coloured by weight-gradient cosine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def plot_heatmap(cosine: np.ndarray, layers: Sequence[str], kernels: Sequence[int], path: str | Path,
                 title: str) -> Path:
    """``cosine[i, j]``: mean weight-gradient cosine of ``layers[i]`` with kernel ``kernels[j]``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, m = cosine.shape
    fig, ax = plt.subplots(figsize=(2.0 + 1.1 * m, 1.2 + 0.32 * n))
    im = ax.imshow(cosine, cmap="viridis", vmin=min(0.0, float(cosine.min())), vmax=1.0, aspect="auto")
    for i in range(n):
        for j in range(m):
            v = cosine[i, j]
            ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=7,
                    color="black" if v > 0.6 else "white")
    ax.set_xticks(range(m), [f"{k}x{k}" for k in kernels])
    ax.set_yticks(range(n), layers, fontsize=7)
    ax.set_xlabel("pooling kernel of the saved input")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="cosine vs exact")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
