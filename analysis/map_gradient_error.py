"""The gradient error of whole maps, measured jointly on one run's weights: per map the relative
error of the whole parameter gradient, its mean over parameter tensors (the menu's
``tensor_error``) and the relative error of each parameter group (conv / linear weights,
BatchNorm weight and bias), beside the menu's additive predictions when a menu is given. It shows
where a map's error lands (docs/proofs.md: lossy BatchNorm inputs at 0.08x on resnet20).

    python analysis/map_gradient_error.py CHECKPOINT MAP.yaml [MAP.yaml ...] [--menu MENU.json]
        [--batches 4] [--batch-size 32] [--draws 1] [--runs DIR]

CHECKPOINT: a run's checkpoint.pt (its config names the model, the dataset and the loss); the
batches are the dataset's first fixed training batches of seed 0 (what ``lessmem-sensitivity``
measures on), one rounding draw per batch; ``--draws R``: each batch's gradient averaged over R
rounding draws. Stochastic rounding is unbiased, so its part of the error falls like 1/R; what
stays is bias (pooling's block means, a deterministic error that training steps do not average out).
``--runs DIR``: a criterion check's folder (analysis/proof.py --criterion-check) that trained these
maps, each under its file's name: Spearman's rho of each measured error with the final metric
(sign turned as criterion_summary does: +1 is a perfect predictor).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from compact_runs import by_seed, load
from criterion_summary import spearman
from omegaconf import OmegaConf
from proof_summary import layout_of
from torch import Tensor, nn

from lessmem.core import CompressionPlan, compress
from lessmem.experiment import fixed_batches, load_checkpoint, model_spec, task_of
from lessmem.sensitivity import MenuResult


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a step updates (a LoRA model's adapters; every parameter of a full run)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def groups(model: nn.Module) -> dict[str, list[int]]:
    """Trainable parameter indices per group: BatchNorm weight and bias, LoRA adapters by projection
    and side (``q_proj.lora_A``), and the rest (conv / linear); empty groups left out."""
    norm = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()}
    out: dict[str, list[int]] = {"conv / linear": [], "batchnorm": []}
    for i, (name, p) in enumerate(trainable(model)):
        parts = name.split(".")
        lora = next((k for k, part in enumerate(parts) if part.startswith("lora_")), None)
        key = "batchnorm" if id(p) in norm else f"{parts[lora - 1]}.{parts[lora]}" if lora else "conv / linear"
        out.setdefault(key, []).append(i)
    return {k: v for k, v in out.items() if v}


def gradients(model: nn.Module, batches: list[tuple[Tensor, Tensor]], loss_fn: nn.Module) -> list[list[Tensor]]:
    out = []
    for x, y in batches:
        model.zero_grad()
        loss_fn(model(x), y).backward()
        out.append([p.grad.detach().double().clone() for _, p in trainable(model)])
    return out


def averaged(model: nn.Module, batches: list[tuple[Tensor, Tensor]], loss_fn: nn.Module,
             draws: int) -> list[list[Tensor]]:
    """Each batch's gradients averaged over ``draws`` passes (the rounding noise moves on each call);
    a running sum, so memory stays one pass's gradients whatever ``draws``."""
    total = gradients(model, batches, loss_fn)
    for _ in range(draws - 1):
        for acc, grads in zip(total, gradients(model, batches, loss_fn), strict=True):
            for a, g in zip(acc, grads, strict=True):
                a += g
    return [[a / draws for a in acc] for acc in total]


def rel(a: list[Tensor], e: list[Tensor]) -> float:
    num = sum(float((x - y).square().sum()) for x, y in zip(a, e, strict=True))
    den = sum(float(y.square().sum()) for y in e)
    return num / den if den > 0 else 0.0


def errors(approx: list[list[Tensor]], exact: list[list[Tensor]], parts: dict[str, list[int]]) -> dict[str, float]:
    n = len(exact)
    result = {"whole": sum(rel(a, e) for a, e in zip(approx, exact, strict=True)) / n,
              "tensor_error": sum(sum(rel([x], [y]) for x, y in zip(a, e, strict=True) if y.any())
                                  / sum(bool(y.any()) for y in e) for a, e in zip(approx, exact, strict=True)) / n}
    for name, idx in parts.items():
        result[name] = sum(rel([a[i] for i in idx], [e[i] for i in idx]) for a, e in zip(approx, exact, strict=True)) / n
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("maps", type=Path, nargs="+")
    p.add_argument("--menu", type=Path, default=None, help="a menu.json: its additive predictions beside")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--draws", type=int, default=1, help="rounding draws averaged per batch")
    p.add_argument("--runs", type=Path, default=None, help="a criterion check's folder: rank the errors against its metric")
    args = p.parse_args(argv)
    cfg = OmegaConf.create(torch.load(args.checkpoint, map_location="cpu", weights_only=True)["config"])
    net = model_spec(cfg.model).build()
    load_checkpoint(net, args.checkpoint)
    net.train()
    batches = fixed_batches(cfg.dataset, args.batches, args.batch_size)
    loss_fn = task_of(cfg).criterion
    exact = gradients(copy.deepcopy(net), batches, loss_fn)
    parts = groups(net)
    menu = MenuResult.load(args.menu) if args.menu else None
    table: dict[str, dict[str, float]] = {}
    for path in args.maps:
        plan = CompressionPlan.read(path)
        compressed = compress(copy.deepcopy(net), plan)
        measured = errors(averaged(compressed, batches, loss_fn, args.draws), exact, parts)
        table[path.stem] = measured
        line = f"{path.stem}: measured " + ", ".join(f"{k} {v:.4g}" for k, v in measured.items())
        if menu is not None:
            score = menu.score(plan)
            line += " | menu " + ", ".join(f"{c} {score[c]:.4g}" for c in (*menu.criteria, "ratio"))
        print(line, flush=True)
    if args.runs is not None:
        rank_against_runs(table, args.runs)
    return 0


def rank_against_runs(table: dict[str, dict[str, float]], out: Path) -> None:
    """Spearman's rho of each measured error with the final metric of the runs that trained the
    maps (seed 0; stock, when trained, as a map of zero error)."""
    layout, runs = layout_of(out), load(out)
    sign = 1.0 if layout["lower_is_better"] else -1.0
    keys = list(next(iter(table.values())))
    final = {name: by_seed(runs, name)[0][layout["metric"]] for name in [*table, "stock"]
             if 0 in by_seed(runs, name)}
    rows = {name: table.get(name, dict.fromkeys(keys, 0.0)) for name in final}
    if len(rows) < 3:
        raise SystemExit(f"map_gradient_error: error: {out} has seed-0 runs of only {sorted(rows)}")
    for key in keys:
        rho = sign * spearman([rows[n][key] for n in rows], [final[n] for n in rows])
        print(f"Spearman rho of measured {key} with final {layout['metric']} over {len(rows)} maps: {rho:+.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
