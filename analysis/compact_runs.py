"""One tracked file per result folder, ``<out>/runs.json``, with every finished training run's metrics
and the drivers' other outputs, so that the published summaries regenerate from git while the raw
folders stay out of it.

The drivers (proof.py, proof_2x2.py, criterion_check.py) write ``<out>/runs/<config>/seed<N>/``
(config.yaml, metrics.json, metrics.jsonl, memory.json, checkpoints); ``.gitignore`` keeps those out
of git. ``runs.json`` holds, per configuration and seed, the run's metrics.json (less its per-layer
byte table), the proof it was copied from (``REUSED``) and the maps the adaptive schedule chose
(``adaptive.jsonl``), the first stock run's config.yaml (the schedule the summaries print), the
text of every map file in ``<out>/maps/`` (what each configuration trained; ``maps/`` is not tracked)
and, under ``files``, every other driver output of ``CARRIED`` that git does not track (proof.json,
the measured menu, the searches' summaries, trials, reports and best maps, per-epoch sensitivity
tables; a ``.json`` parsed, the rest as text; ``{"same_as": FOLDER}``: the same file of another
result folder). Plots and CSV views of a JSON file are not carried: the scripts that wrote them
write them again.

    python analysis/compact_runs.py docs/results/budget_proof             # after the runs finished
    python analysis/compact_runs.py --restore docs/results/budget_proof   # maps/ and the carried files back, to rerun
    python analysis/compact_runs.py --restore-maps docs/results/budget_proof   # maps/ only
    python analysis/compact_runs.py --publish /work/runs/proof_lm42 docs/results/proof_lm_converged
    python analysis/compact_runs.py --pack /work/runs/proof_c42 docs/results/cifar10_converged_partial.tar

``--publish SRC DEST``: runs made outside the checkout (a frozen worktree's proof writing elsewhere, so
that a session's end stops nothing of the tree) into ``DEST/runs.json``, every ``SRC`` path named as
``DEST``'s (``DEST/maps/``, ``DEST/runs/``: what ``--restore`` writes back there), and a path beside the
checkout (the data root) relative to it, as the configs name it (``../shared/data/cifar10``). Runs that
``DEST/runs.json`` has and ``SRC`` has not stay: a proof's seeds can be run on different machines.

``--pack SRC TAR``: the runs a session's end stopped, for a new machine (only commits survive a change of
machine): every unfinished run folder of ``SRC/runs`` (a step checkpoint, no metrics.json), whole, and the
files at ``SRC``'s top (launch scripts, layouts; not runs.json, which ``--publish`` carries, nor logs).
Unpacked with ``tar -xf TAR -C DIR`` after ``--restore DIR``, each run resumes where it stopped.

The summary scripts call ``load``, which rewrites runs.json first whenever raw run folders exist, and
read the carried files with ``read`` (the file when it is there, else runs.json's copy).
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import yaml
from repo_paths import REPO, relative_to_repo

DROPPED = ("saved_bytes_per_layer",)  # 58 numbers per run; each run's memory.json keeps them
# Driver outputs runs.json carries (paths relative to the result folder; ``*`` within one path part).
CARRIED = (
    "proof.json",                                                    # analysis/proof.py: the layout
    "menu/menu.json", "menu_*/menu.json", "menu/menu_*.yaml",        # lessmem-sensitivity: the menu, its map
    "search/b*/summary.json", "search/b*/report.md", "search/b*/trials.csv", "search/b*/best_map.yaml",
    "search/b*/sweep.yaml", "search/b*/COPIED",                      # the menu searches (lessmem-search)
    "search/summary.json", "search/pareto.md", "search/pareto.csv", "search/trials.csv", "search/sweep.yaml",
    "search/best_maps/*.yaml", "search/sensitivity/sensitivity.json",  # proof_2x2.py's accuracy search
    "sensitivity/epoch*/sensitivity.json", "sensitivity/epoch*/greedy_map.yaml",  # proof_2x2.py, per epoch
)


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
    tracked = load_tracked(out)
    maps = tracked["maps"] | {p.stem: p.read_text() for p in (out / "maps").glob("*.yaml")}
    files = tracked.get("files", {}) | carry(out)
    table = relative_to_repo({"runs": runs, "stock_config": yaml.safe_load(stock[0].read_text()) if stock else None,
                              "maps": dict(sorted(maps.items())), **({"files": dict(sorted(files.items()))} if files else {})})
    (out / "runs.json").write_text(json.dumps(table, indent=1) + "\n")
    return table


def publish(src: Path, dest: Path) -> dict:
    """``src``'s runs compacted into ``dest/runs.json``, its paths named as ``dest``'s. What
    ``dest/runs.json`` had stays where ``src`` has nothing in its place (a run, a map, a carried
    file, the stock schedule): seeds run on another machine join those published before."""
    table = compact(src)
    dest = dest.resolve()
    target = relative_to_repo(str(dest))
    text = json.dumps(table, indent=1)
    mark = "\0dest\0"  # DEST may itself lie beside the checkout: put it in after the rewrite below
    for source in {str(src.resolve()), str(src.absolute())}:
        text = text.replace(f"{source}/", f"{mark}/").replace(f'"{source}"', f'"{mark}"')
    text = text.replace(f'"{REPO.parent}/', '"../')  # beside the checkout (the data root): as the configs name it
    text = text.replace(mark, target)
    table = _merged(load_tracked(dest), json.loads(text))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "runs.json").write_text(json.dumps(table, indent=1) + "\n")
    return table


def pack(src: Path, tar: Path) -> list[str]:
    """Write the unfinished runs of ``src`` and its top-level files into ``tar``; their names."""
    runs = [p.parent for p in sorted((src / "runs").glob("*/seed*/checkpoint.pt"), key=_run_order)
            if not (p.parent / "metrics.json").exists()]
    tops = [p for p in sorted(src.iterdir()) if p.is_file() and p.name != "runs.json" and p.suffix != ".log"]
    names = [path.relative_to(src).as_posix() for path in runs + tops]
    with tarfile.open(tar, "w") as archive:
        for path, name in zip(runs + tops, names, strict=True):
            archive.add(path, arcname=name)
    return names


def _merged(old: dict, new: dict) -> dict:
    """``new`` over ``old``: runs by configuration and seed, maps and carried files by name."""
    runs = {config: {**old["runs"].get(config, {}), **new["runs"].get(config, {})}
            for config in sorted(old["runs"].keys() | new["runs"].keys())}
    files = old.get("files", {}) | new.get("files", {})
    return {"runs": {config: dict(sorted(seeds.items(), key=lambda kv: int(kv[0]))) for config, seeds in runs.items()},
            "stock_config": new["stock_config"] or old["stock_config"],
            "maps": dict(sorted((old["maps"] | new["maps"]).items())),
            **({"files": dict(sorted(files.items()))} if files else {})}


def carry(out: Path) -> dict[str, Any]:
    """The ``CARRIED`` files in ``out`` that git does not track (a tracked one stays a file)."""
    tracked = _git_tracked(out)
    found = {}
    for pattern in CARRIED:
        for path in out.glob(pattern):
            name = path.relative_to(out).as_posix()
            if path.is_file() and name not in tracked:
                found[name] = json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()
    return found


def _git_tracked(out: Path) -> set[str]:
    """Files under ``out`` that git tracks, relative to it (none outside a checkout)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "."], cwd=out, capture_output=True, text=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return set()
    return {name for name in listed.split("\0") if name}


def read(out: Path, name: str, table: dict | None = None) -> Any:
    """A result file of ``out`` (a path relative to it): the file when it is there (parsed when
    ``.json``), else what runs.json carries (``same_as``: that folder's), else None."""
    path = out / name
    if path.is_file():
        return json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()
    value = (load_tracked(out) if table is None else table).get("files", {}).get(name)
    if isinstance(value, dict) and set(value) == {"same_as"}:
        return read(REPO / value["same_as"], name)
    return value


def names(out: Path, pattern: str, table: dict | None = None) -> list[str]:
    """The result files of ``out`` that match ``pattern`` (``*`` within one path part), on disk or
    carried, sorted."""
    found = {p.relative_to(out).as_posix() for p in out.glob(pattern) if p.is_file()}
    carried = (load_tracked(out) if table is None else table).get("files", {})
    depth = pattern.count("/")
    found |= {n for n in carried if n.count("/") == depth and fnmatch.fnmatchcase(n, pattern)}
    return sorted(found)


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


def restore(out: Path, table: dict) -> None:
    """The map files and every carried file back where the drivers wrote them (where missing):
    what a rerun reads (``--menu DIR/menu/menu.json``, ``--map-files DIR/maps/...``)."""
    restore_maps(out, table)
    for name in table.get("files", {}):
        path = out / name
        if not path.exists():
            value = read(out, name, table)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value, indent=1) + "\n" if path.suffix == ".json" else value)


def by_seed(table: dict, config: str) -> dict[int, dict]:
    """seed -> metrics of one configuration's runs, in seed order."""
    return {int(seed): m for seed, m in sorted(table["runs"].get(config, {}).items(), key=lambda kv: int(kv[0]))}


def _run_order(path: Path) -> tuple[str, int]:
    seed_dir = path.parent
    return seed_dir.parent.name, int(seed_dir.name[4:])


def main(argv: list[str]) -> int:
    usage = {"--publish": "SRC DEST", "--pack": "SRC TAR"}.get(argv[0]) if argv else None  # SRC and a destination
    if usage is not None:
        verb = argv[0]
        if len(argv) != 3 or not (Path(argv[1]) / "runs").is_dir():
            print(f"compact_runs.py: error: {verb} {usage}, SRC a result folder with runs/", file=sys.stderr)
            return 2
        if verb == "--publish":
            table = publish(Path(argv[1]), Path(argv[2]))
            print(f"{Path(argv[2]) / 'runs.json'}: {sum(map(len, table['runs'].values()))} runs from {argv[1]}")
        else:
            print(f"{argv[2]}: {', '.join(pack(Path(argv[1]), Path(argv[2]))) or 'nothing unfinished'}")
        return 0
    back = {"--restore": restore, "--restore-maps": restore_maps}.get(argv[0]) if argv else None
    folders = [Path(a) for a in argv[back is not None:]]
    if not folders:
        print("compact_runs.py: error: give one or more result folders", file=sys.stderr)
        return 2
    for folder in folders:
        if back is not None:
            back(folder, load(folder))
            continue
        if not (folder / "runs").is_dir():
            print(f"compact_runs.py: error: {folder / 'runs'} does not exist", file=sys.stderr)
            return 2
        table = compact(folder)
        print(f"{folder / 'runs.json'}: {sum(map(len, table['runs'].values()))} runs, {len(table['runs'])} configurations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
