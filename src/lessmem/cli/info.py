"""``lessmem-info``: what there is to choose from, and where configs and data are looked for.

    lessmem-info                 # everything
    lessmem-info compression     # one config group (model, compression, dataset, optimizer, ...)
    lessmem-info --json          # machine-readable

Lists the model architectures of the registry (``lessmem.models.MODELS``, ``model.name=...``),
every option of each config group (``GROUP=OPTION`` on the ``lessmem-train`` command line)
with its description: the first line of the file's leading comment, one full sentence (further
comment lines give details), and what a compression map's values may say (``SPEC_SYNTAX``, and
the storages of ``lessmem.core.STORAGES``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lessmem.core import STORAGES, describe_storage
from lessmem.experiment import conf_dir, default_data_root, resolve_path

MAP_COMMAND_LINE = '''lessmem-train compression=pool2 'compression.map="layer1.*:4,layer2.0.conv1:2/int4,*:2"'''

GROUPS = ("model", "compression", "dataset", "optimizer", "scheduler", "logger", "experiment",
          "hydra/launcher")
# The forms of a compression map value (lessmem.core.parse_spec), each with what it keeps.
SPEC_SYNTAX = {
    "k": "pool the saved input k x k (1: the stock layer, exact)",
    "khxkw": "pool kh x kw (e.g. 2x4)",
    "k/STORAGE": "pool k x k and keep the pooled copy in STORAGE (also khxkw/STORAGE)",
    "STORAGE": "no pooling (kernel 1), the input kept in STORAGE",
    "from_bn": "a conv after BatchNorm + ReLU / ReLU6 / Hardtanh: nothing kept, rebuilt from what those keep",
}


def _describe(path: Path) -> str:
    """The description of a config file: its first comment line (``# @package`` lines skipped)."""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text and not text.startswith("@package"):
            return text
    return ""


def config_options(conf: Path | None = None) -> dict[str, dict[str, str]]:
    """``{group: {option: description}}`` of the config directory."""
    conf = conf or conf_dir()
    out: dict[str, dict[str, str]] = {}
    for group in GROUPS:
        folder = conf / group
        if folder.is_dir():
            out[group] = {p.stem: _describe(p) for p in sorted(folder.glob("*.yaml"))}
    return out


def available() -> dict[str, Any]:
    from lessmem import __version__
    from lessmem.models import MODELS

    cifar = resolve_path(default_data_root("cifar10"))
    return {
        "version": __version__,
        "conf_dir": str(conf_dir()),
        "conf_from_env": bool(os.environ.get("LESSMEM_CONF")),
        "cifar10_root": str(cifar),
        "cifar10_found": (cifar / "train").is_dir(),
        "architectures": sorted(MODELS),
        "groups": config_options(),
        "spec_syntax": SPEC_SYNTAX,
        "map_form": MAP_COMMAND_LINE,
        "storages": {storage: describe_storage(storage) for storage in STORAGES},
    }


def render(info: dict[str, Any], groups: Sequence[str] = ()) -> str:
    lines = []
    if not groups:
        where = "$LESSMEM_CONF" if info["conf_from_env"] else "package; LESSMEM_CONF=DIR overrides"
        found = "found" if info["cifar10_found"] else (
            "missing: set dataset.root=... or LESSMEM_DATA=..., or dataset.download=true with internet")
        lines += [
            f"lessmem {info['version']}",
            f"configs:  {info['conf_dir']} ({where})",
            f"CIFAR-10: {info['cifar10_root']} ({found})",
            "",
            f"model architectures (model.name=...): {', '.join(info['architectures'])}",
            "",
            "config groups (GROUP=OPTION on the lessmem-train command line):",
        ]
    for group, options in info["groups"].items():
        if groups and group not in groups:
            continue
        lines.append(f"  {group}:")
        width = max((len(o) for o in options), default=0)
        lines += [f"    {o.ljust(width)}  {d}".rstrip() for o, d in options.items()]
    if not groups or "compression" in groups:
        lines += ["", *_spec_lines(info)]
    return "\n".join(lines)


def _spec_lines(info: dict[str, Any]) -> list[str]:
    """How a compression map's values read: {PATTERN: SPEC} in a compression config or map file;
    on the command line one string of PATTERN:SPEC pairs (globs and dotted names as written)."""
    width = max(len(k) for k in (*info["spec_syntax"], *info["storages"]))
    return [
        "compression map values ({PATTERN: SPEC} in a config or map file, first matching pattern wins;",
        f"on the command line the whole map as one string: {info['map_form']}):",
        *[f"  {form.ljust(width)}  {text}" for form, text in info["spec_syntax"].items()],
        "storages:",
        *[f"  {storage.ljust(width)}  {text}" for storage, text in info["storages"].items()],
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lessmem-info", description="List models, compression presets, datasets, optimizers, "
        "schedulers, loggers, experiments and launchers; show where configs and data are found.")
    parser.add_argument("groups", nargs="*", metavar="GROUP", help=f"only these groups: {', '.join(GROUPS)}")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown:
        print(f"lessmem-info: error: unknown group(s) {unknown}; groups: {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    info = available()
    if args.json and args.groups:
        info["groups"] = {g: o for g, o in info["groups"].items() if g in args.groups}
    try:
        print(json.dumps(info, indent=1) if args.json else render(info, args.groups), flush=True)
    except BrokenPipeError:  # the reader left (`lessmem-info --json | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
