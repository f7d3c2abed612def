"""Files made from sensitivity results: a generated compression map (a ``compression`` config
group file) and sensitivity tracked over training (appended csv rows)."""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path

from lessmem.layer_sensitivity.result import SensitivityResult


def write_map_yaml(mapping: Mapping[str, int], path: str | Path, name: str | None = None,
                   comment: str | None = None) -> Path:
    """Write ``mapping`` as a compression config group file (``conf/compression/<name>.yaml``)."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "name": name or path.stem,
        "map": {str(k): int(v) for k, v in mapping.items()},
        "map_file": None,
        "norm_storage": "native",
        "exact_companions": True,
    }
    header = "".join(f"# {line}\n" for line in (comment or "").splitlines())
    path.write_text(header + yaml.safe_dump(body, sort_keys=False))
    return path


def append_history(result: SensitivityResult, path: str | Path, step: int, epoch: int | None = None) -> None:
    """Append one result as rows (step, epoch, layer, kernel, cosine, ...) to a CSV: sensitivity
    tracked over training, measured at checkpoints on a fixed batch."""
    path = Path(path)
    rows = [{"step": step, "epoch": epoch, **r} for r in result.rows()]
    new = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)
