"""One tracked file per result folder with every finished training run's metrics, ``<out>/runs.json``,
so that the published summaries regenerate from git while the raw run folders stay out of it.

The drivers (proof.py, proof_2x2.py, criterion_check.py) write ``<out>/runs/<config>/seed<N>/``
(config.yaml, metrics.json, metrics.jsonl, memory.json, checkpoints); ``.gitignore`` keeps those out
of git. ``runs.json`` holds, per configuration and seed, the run's metrics.json (less its per-layer
byte table), the proof it was copied from (``REUSED``) and the maps the adaptive schedule chose
(``adaptive.jsonl``), the first stock run's config.yaml (the schedule the summaries print), and the
text of every map file in ``<out>/maps/`` (what each configuration trained; ``maps/`` is not tracked).

    python analysis/compact_runs.py docs/results/budget_proof             # after the runs finished
    python analysis/compact_runs.py --restore-maps docs/results/budget_proof   # maps/ back, to rerun

The summary scripts call ``load``, which rewrites runs.json first whenever raw run folders exist.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from repo_paths import relative_to_repo

DROPPED = ("saved_bytes_per_layer",)  # 58 numbers per run; each run's memory.json keeps them


def compact(out: Path) -> dict:
    """Read ``out/runs/*/seed*/`` and write ``out/runs.json``."""
    runs: dict[str, dict[str, dict]] = {}
    for metrics in sorted((out / "runs").glob("*/seed*/metrics.json"), key=_run_order):
        run = metrics.parent
        record = {k: v for k, v in json.loads(metrics.read_text()).items() if k not in DROPPED}
        if (run / "REUSED").is_file():
            record["reused_from"] = (run / "REUSED").read_text().strip()
        if (run / "adaptive.jsonl").is_file():
            lines = (run / "adaptive.jsonl").read_text().splitlines()
            record["adaptive"] = [json.loads(line) for line in lines if line.strip()]
        runs.setdefault(run.parent.name, {})[run.name[4:]] = record
    stock = sorted((out / "runs" / "stock").glob("seed*/config.yaml"), key=_run_order)
    maps = load_tracked(out)["maps"] | {p.stem: p.read_text() for p in (out / "maps").glob("*.yaml")}
    table = relative_to_repo({"runs": runs, "stock_config": yaml.safe_load(stock[0].read_text()) if stock else None,
                              "maps": dict(sorted(maps.items()))})
    (out / "runs.json").write_text(json.dumps(table, indent=1) + "\n")
    return table


def load(out: Path) -> dict:
    """The runs of a result folder: compacted afresh from its raw run folders when they exist, else
    its tracked runs.json; empty when it has neither."""
    return compact(out) if (out / "runs").is_dir() else load_tracked(out)


def load_tracked(out: Path) -> dict:
    """runs.json as tracked (maps kept from it when a rerun's maps/ is incomplete)."""
    path = out / "runs.json"
    return json.loads(path.read_text()) if path.is_file() else {"runs": {}, "stock_config": None, "maps": {}}


def restore_maps(out: Path, table: dict) -> None:
    """Write ``out/maps/<name>.yaml`` from runs.json where missing (a fresh checkout has none)."""
    for name, text in table["maps"].items():
        path = out / "maps" / f"{name}.yaml"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def by_seed(table: dict, config: str) -> dict[int, dict]:
    """seed -> metrics of one configuration's runs, in seed order."""
    return {int(seed): m for seed, m in sorted(table["runs"].get(config, {}).items(), key=lambda kv: int(kv[0]))}


def _run_order(path: Path) -> tuple[str, int]:
    seed_dir = path.parent
    return seed_dir.parent.name, int(seed_dir.name[4:])


def main(argv: list[str]) -> int:
    restore = argv[:1] == ["--restore-maps"]
    folders = [Path(a) for a in argv[restore:]]
    if not folders:
        print("compact_runs.py: error: give one or more result folders", file=sys.stderr)
        return 2
    for folder in folders:
        if restore:
            restore_maps(folder, load(folder))
            continue
        if not (folder / "runs").is_dir():
            print(f"compact_runs.py: error: {folder / 'runs'} does not exist", file=sys.stderr)
            return 2
        table = compact(folder)
        print(f"{folder / 'runs.json'}: {sum(map(len, table['runs'].values()))} runs, {len(table['runs'])} configurations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
