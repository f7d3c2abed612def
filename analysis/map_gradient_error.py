"""The gradient error of whole maps, measured jointly on one run's weights: per map the relative
error of the whole parameter gradient, its mean over parameter tensors (the menu's
``tensor_error``) and the relative error of each parameter group (conv / linear weights,
BatchNorm weight and bias), beside the menu's additive predictions when a menu is given. It shows
where a map's error lands (docs/proofs.md: lossy BatchNorm inputs at 0.08x on resnet20).

    python analysis/map_gradient_error.py CHECKPOINT MAP.yaml [MAP.yaml ...] [--menu MENU.json]
        [--batches 4] [--batch-size 32]

CHECKPOINT: a run's checkpoint.pt (its config names the model and the image dataset); batches are
drawn from the training images (seed 0), one rounding draw per batch.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core import compress
from lessmem.models.registry import build_model
from lessmem.sensitivity import MenuResult, read_map_yaml


def groups(model: nn.Module) -> dict[str, list[int]]:
    """Parameter indices per group: BatchNorm weight and bias, and the rest (conv / linear)."""
    norm = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()}
    out: dict[str, list[int]] = {"conv / linear": [], "batchnorm": []}
    for i, p in enumerate(model.parameters()):
        out["batchnorm" if id(p) in norm else "conv / linear"].append(i)
    return out


def gradients(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> list[list[Tensor]]:
    out = []
    for x, y in batches:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        out.append([p.grad.detach().double().clone() for p in model.parameters()])
    return out


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


def image_batches(cfg: dict, n: int, size: int) -> list[tuple[Tensor, Tensor]]:
    import torchvision
    from torchvision import transforms

    data = cfg["dataset"]
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(data["mean"], data["std"])])
    images = torchvision.datasets.ImageFolder(str(Path(data["root"]) / "train"), tf)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[: n * size]
    xs = torch.stack([images[int(i)][0] for i in order])
    ys = torch.tensor([images[int(i)][1] for i in order])
    return [(xs[i : i + size], ys[i : i + size]) for i in range(0, n * size, size)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("maps", type=Path, nargs="+")
    p.add_argument("--menu", type=Path, default=None, help="a menu.json: its additive predictions beside")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    cfg = state["config"]
    model_cfg = {k: v for k, v in cfg["model"].items() if k not in ("name", "num_classes")}
    net = build_model(cfg["model"]["name"], int(cfg["model"]["num_classes"]), **model_cfg)
    net.load_state_dict(state["model"])
    net.train()
    batches = image_batches(cfg, args.batches, args.batch_size)
    exact = gradients(copy.deepcopy(net), batches)
    parts = groups(net)
    menu = MenuResult.load(args.menu) if args.menu else None
    for path in args.maps:
        mapping, norm, act, saved = read_map_yaml(path)
        measured = errors(gradients(compress(copy.deepcopy(net), mapping, norm_storage=norm, act_storage=act,
                                             saved_storage=saved), batches), exact, parts)
        line = f"{path.stem}: measured " + ", ".join(f"{k} {v:.4g}" for k, v in measured.items())
        if menu is not None:
            score = menu.score(mapping, norm, act, saved)
            line += " | menu " + ", ".join(f"{c} {score[c]:.4g}" for c in (*menu.criteria, "ratio"))
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
