"""Memory budgets in bytes of the whole training step: lessmem.fit against PyTorch's
``torch._functorch.config.activation_memory_budget`` (torch.compile, recomputation; exact) and
``torch.utils.checkpoint`` (every block), on one model and batch.

Six budgets from stock's whole-step peak down to the floor lessmem's menu reaches; per budget:
lessmem's chosen map (measured peak, predicted peak, step time, predicted whole-gradient error);
PyTorch's compiled step at the same budget as a fraction of stock's activation bytes (measured
peak, step time); and one checkpointed run. Peaks: ``lessmem.measure_step_memory`` (profiler on
the CPU, ``max_memory_allocated`` on CUDA). Planning view (``--plan``): batch sizes from stock's
largest up to 8x under one budget, each with the best map's predicted peak and error. Peak
curve (``--curve N``): N maps spread over the saved bytes between the floor and stock, each one
measured step against the profile's prediction (the peak model before any verification point).

    python benchmarks/budget.py --model resnet18 --image-size 224 --batch 32 --csv docs/results/budget_resnet18.csv
    python benchmarks/budget.py --model tiny_llama --batch 8 --seq-len 256 --csv docs/results/budget_tiny_llama.csv
    python benchmarks/budget.py --model resnet20 --batch 64 --plan 40MiB --plot docs/results/budget_plan.png
    python benchmarks/budget.py --model resnet20 --image-size 32 --batch 64 --curve 11

Exact view (``--exact F [F ...]``, issue 44): at each fraction F of stock's whole-step peak,
``lessmem.fit(fidelity="exact")`` (measured peak, step time over stock's from the fit's alternating
steps, the largest relative gradient difference to stock's on one step) and
``lessmem.fit(fidelity="lossy")`` (the same, its step timed alternating with stock) beside the
fastest ``torch.utils.checkpoint`` placement whose measured peak fits (per block or per stage, the
first k units of each, most saved bytes per second of forward first) and the compiled step with
``activation_memory_budget`` at the fraction of stock's non-static bytes that targets the budget;
every step time a median of steps alternating with stock's:

    python benchmarks/budget.py --model resnet18 --image-size 224 --batch 32 --exact 0.9 0.8 0.7 0.6 0.55
    python benchmarks/budget.py --plot-exact A.csv B.csv --plot docs/results/budget/exact.png   # the CSVs side by side
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import os
import re
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import lessmem
from lessmem.core import alternating_step_times, training_step
from lessmem.models import build_model
from lessmem.reporting import plot_batch_plan
from lessmem.sensitivity import budget_profile, format_bytes, parse_bytes, plan_batches
from lessmem.sensitivity.exact_fit import forward_seconds, region_candidates
from lessmem.sensitivity.fit import AUTO_STEP_RATIO, STATIC_CATEGORIES

MIB = 2**20
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
NOT_MEASURED = "not measured (--baselines-only)"


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def setup(args: argparse.Namespace):
    """The model, one batch and the loss, on ``args.device``."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    if args.model == "tiny_llama":
        model = build_model("tiny_llama", 256, max_position_embeddings=args.seq_len)
        x = torch.randint(256, (args.batch, args.seq_len))
        return model.to(device), (x.to(device), x.clone().to(device)), lm_loss
    model = build_model(args.model, 1000 if args.image_size >= 64 else 10)
    batch = (torch.randn(args.batch, 3, args.image_size, args.image_size), torch.randint(10, (args.batch,)))
    return model.to(device), tuple(t.to(device) for t in batch), F.cross_entropy


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def step_time(model: nn.Module, batch, loss_fn, steps: int) -> float:
    opt = sgd(model.parameters())
    training_step(model, batch, opt, loss_fn)
    start = time.perf_counter()
    for _ in range(steps):
        training_step(model, batch, opt, loss_fn)
    return (time.perf_counter() - start) / steps


def peak(model: nn.Module, batch, loss_fn) -> int:
    return lessmem.measure_step_memory(model, batch, optimizer=sgd(model.parameters()), loss_fn=loss_fn).peak_bytes


def blocks(model: nn.Module) -> list[str]:
    """The blocks torch.utils.checkpoint wraps: the exact planner's own candidates (ResNet stages'
    blocks, MobileNet's features, decoder layers)."""
    return region_candidates(model)


def checkpointed(model: nn.Module, names: tuple[str, ...] | None = None) -> nn.Module:
    """A copy with ``torch.utils.checkpoint`` around each named module (default: every block)."""
    net = copy.deepcopy(model)
    for name in blocks(net) if names is None else names:
        module = net.get_submodule(name)
        forward = module.forward
        module.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    return net


def stages(model: nn.Module) -> list[str]:
    """The blocks' parents that are ``nn.Sequential`` below the model (torchvision's ``layer1``,
    MobileNet's ``features``): checkpointing a stage keeps its input alone and reruns all its blocks."""
    parents = dict.fromkeys(b.rpartition(".")[0] for b in blocks(model) if "." in b)
    return [p for p in parents if isinstance(model.get_submodule(p), nn.Sequential)]


def placements(model: nn.Module, batch) -> dict[str, list[tuple[str, ...]]]:
    """``torch.utils.checkpoint``'s placements, two ladders (per block, per stage), each the first
    k units for every k, the unit that saves the most bytes per second of forward first (bytes: a
    saved-tensor count with that unit checkpointed; seconds: its forward, least of four)."""
    inputs = batch[0]
    units = {"block": blocks(model), "stage": stages(model)}
    every = [u for names in units.values() for u in names]
    base = lessmem.measure_memory(copy.deepcopy(model).train(), inputs).total_bytes
    seconds = forward_seconds(copy.deepcopy(model).train(), inputs, every)  # one set of forwards times all
    saved = {u: base - lessmem.measure_memory(checkpointed(model, (u,)).train(), inputs).total_bytes for u in every}
    ladders = {}
    for ladder, names in units.items():
        order = sorted(names, key=lambda u: -saved[u] / max(seconds[u], 1e-9))
        if order:
            ladders[ladder] = [tuple(order[:k]) for k in range(1, len(order) + 1)]
    return ladders


def fitting_placements(ladders: dict[str, list[tuple[str, ...]]], peaks: dict[tuple[str, ...], int],
                       budget: int) -> list[tuple[str, ...]]:
    """On each ladder the first placement whose measured peak (``peaks``) fits ``budget``: the one
    with the fewest units, so the fewest reruns; the caller times them and keeps the faster."""
    return [next(p for p in ladder if peaks[p] <= budget) for ladder in ladders.values()
            if any(peaks[p] <= budget for p in ladder)]


def compiled_budget(model: nn.Module, fraction: float) -> nn.Module:
    import torch._dynamo
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    functorch_config.activation_memory_budget = fraction
    return torch.compile(copy.deepcopy(model))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--budgets", type=int, default=6)
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    p.add_argument("--no-compile", action="store_true", help="skip activation_memory_budget")
    p.add_argument("--fresh-all", action="store_true", help="time a fresh-cache choice at every budget")
    p.add_argument("--plan", help="a budget (e.g. 6GiB): the planning view instead")
    p.add_argument("--curve", type=int, default=0, help="N maps' measured peaks against the profile's prediction instead")
    p.add_argument("--exact", type=float, nargs="+", help="fractions of stock's peak: the exact view instead")
    p.add_argument("--plot-exact", nargs="+", metavar="CSV", help="plot exact views' CSVs side by side (--plot) and stop")
    p.add_argument("--baselines-only", action="store_true",
                   help="the exact view's checkpoint and compiled columns alone (lessmem's fits not run)")
    p.add_argument("--max-step-ratio", type=float, default=AUTO_STEP_RATIO,
                   help="lessmem.fit's time allowance (lossy: reruns of recomputed regions; 1: codes only)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (peaks: max_memory_allocated there)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                   help="the exact view's step clock on the CPU: process CPU time (steadier on a shared machine) or wall")
    p.add_argument("--csv")
    p.add_argument("--plot")
    args = p.parse_args()
    if args.plot_exact:
        return plot_exact(args.plot_exact, args.plot)
    torch.set_num_threads(1)
    model, batch, loss_fn = setup(args)
    if args.exact:
        return exact(model, batch, loss_fn, args)
    os.environ["LESSMEM_CACHE"] = tempfile.mkdtemp()  # a fresh cache: the profile's cost is measured
    start = time.perf_counter()
    profile = budget_profile(model, batch, optimizer=sgd, loss_fn=loss_fn)
    t_profile = time.perf_counter() - start
    t_step = step_time(copy.deepcopy(model).train(), batch, loss_fn, args.steps)
    print(f"{args.model} b{args.batch}: menu on {profile.menu.meta['measured_batch']} samples, stock peak "
          f"{profile.stock_peak / MIB:.1f} MiB, floor {profile.floor_peak / MIB:.1f} MiB, profile {t_profile:.1f}s = "
          f"{t_profile / t_step:.1f} stock steps ({t_step:.2f}s each)", flush=True)
    if args.plan:
        return plan(profile, parse_bytes(args.plan), args)
    if args.curve:
        return curve(model, batch, loss_fn, profile, args)
    rows = []
    static = profile.peaks.static_bytes
    for i in range(args.budgets):
        budget = int(profile.stock_peak - (profile.stock_peak - profile.floor_peak) * (i + 0.5) / args.budgets)
        t0 = time.perf_counter()
        choice = lessmem.fit(model, batch, budget, optimizer=sgd, loss_fn=loss_fn, max_step_ratio=args.max_step_ratio)
        t_fit = time.perf_counter() - t0
        net = lessmem.compress(copy.deepcopy(model).train(), choice.plan)
        row = {"budget": budget, "budget_mib": budget / MIB, "lessmem_peak_mib": choice.step_peak_bytes / MIB,
               "lessmem_predicted_mib": choice.predicted_peak_bytes / MIB,
               "lessmem_step_s": step_time(net, batch, loss_fn, args.steps),
               "lessmem_grad_error": choice.score.get("grad_error", 0.0),
               "lessmem_tensor_error": choice.score.get("tensor_error", 0.0), "recomputed": len(choice.plan.recompute),
               "fit_step_ratio": choice.step_time_ratio or "", "fit_s": t_fit, "verified": choice.verified,
               "known": int(choice.known)}
        if not args.no_compile:
            fraction = min(1.0, max(0.0, (budget - static) / (profile.stock_peak - static)))
            net = compiled_budget(model, fraction).train()
            t = step_time(net, batch, loss_fn, args.steps)
            row.update(compile_fraction=fraction, compile_peak_mib=peak(net, batch, loss_fn) / MIB, compile_step_s=t)
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    # The choice as a user pays for it: one fit() call on a fresh cache (profile and verification,
    # one warmed copy for all its steps), at the budget whose verification took longest above
    # (--fresh-all: at every budget), divided by a stock step timed right after it.
    for row in rows if args.fresh_all else [max(rows, key=lambda r: r["fit_s"])]:
        os.environ["LESSMEM_CACHE"] = tempfile.mkdtemp()
        t0 = time.perf_counter()
        choice = lessmem.fit(model, batch, row["budget"], optimizer=sgd, loss_fn=loss_fn, max_step_ratio=args.max_step_ratio)
        t_choice = time.perf_counter() - t0
        t_after = step_time(copy.deepcopy(model).train(), batch, loss_fn, args.steps)
        row.update(choice_s=t_choice, choice_steps=t_choice / t_after, choice_peak_mib=choice.step_peak_bytes / MIB)
        print(f"choice at {row['budget_mib']:.1f} MiB on a fresh cache: {t_choice:.1f}s = {t_choice / t_after:.1f} "
              f"stock steps ({t_after:.2f}s each, timed right after), {choice.verified} verified, peak "
              f"{choice.step_peak_bytes / MIB:.1f} MiB (predicted {choice.predicted_peak_bytes / MIB:.1f})", flush=True)
    net = checkpointed(model).train()
    ck = {"checkpoint_peak_mib": peak(net, batch, loss_fn) / MIB, "checkpoint_step_s": step_time(net, batch, loss_fn, args.steps),
          "stock_peak_mib": profile.stock_peak / MIB, "stock_step_s": t_step}
    print(" ".join(f"{k}={v:.3f}" for k, v in ck.items()))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*dict.fromkeys(k for r in rows for k in r), *ck])
            writer.writeheader()
            writer.writerows([{**r, **ck} for r in rows])
    if args.plot:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        b = [r["budget_mib"] for r in rows]
        ax.plot(b, b, "k:", label="budget")
        ax.plot(b, [r["lessmem_peak_mib"] for r in rows], "o-", label="lessmem.fit (measured)")
        if "compile_peak_mib" in rows[0]:
            ax.plot(b, [r["compile_peak_mib"] for r in rows], "s--", label="activation_memory_budget")
        ax.axhline(ck["checkpoint_peak_mib"], color="grey", ls="--", label="checkpoint every block")
        ax.set(xlabel="budget (MiB)", ylabel="whole-step peak (MiB)", title=f"{args.model} batch {args.batch}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


def grads_of(model: nn.Module, batch, loss_fn) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    loss_fn(model(batch[0]), batch[1]).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def max_relative_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest over parameter tensors of ||g - g_stock|| / max(||g_stock||, 1e-3 of the largest
    tensor's ||g_stock||): a tensor whose gradient is zero but for float noise (a BatchNorm bias whose
    output the next BatchNorm centres: ~1e-8 in MobileNet's projections, against ~1e-1 elsewhere)
    compares its noise to the gradients' scale, not to itself."""
    floor = 1e-3 * max(float(r.norm()) for r in reference)
    return max(float((g - r).norm()) / max(float(r.norm()), floor) for g, r in zip(grads, reference, strict=True))


def max_elementwise_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest elementwise difference to stock's gradient, over that tensor's largest magnitude."""
    return max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in zip(grads, reference, strict=True))


def step_ratios(stock: nn.Module, others: list[nn.Module], batch, loss_fn, steps: int, clock: str) -> list[float]:
    """Each of ``others``' median step time over ``stock``'s, all their steps taking turns."""
    nets = [stock, *others]
    opts = [sgd(net.parameters()) for net in nets]
    calls = [lambda n=n, o=o: training_step(n, batch, o, loss_fn) for n, o in zip(nets, opts, strict=True)]
    device = batch[0].device  # CUDA: wall time, synchronized (a process's CPU time does not see the GPU)
    times = alternating_step_times(calls, steps, clock=CLOCKS["wall" if device.type == "cuda" else clock], device=device)
    medians = [statistics.median(t) for t in times]
    return [m / medians[0] for m in medians[1:]]


def exact(model: nn.Module, batch, loss_fn, args: argparse.Namespace) -> None:
    """The exact view (module docstring): per budget one round of alternating steps times stock,
    the exact plan, the lossy plan, the fitting checkpoint placements and the compiled step."""
    os.environ["LESSMEM_CACHE"] = tempfile.mkdtemp()
    stock = copy.deepcopy(model).train()
    report = lessmem.measure_step_memory(stock, batch, optimizer=sgd(stock.parameters()), loss_fn=loss_fn)
    stock_peak = report.peak_bytes
    static = sum(report.by_category.get(c, 0) for c in STATIC_CATEGORIES)
    reference = grads_of(copy.deepcopy(model).train(), batch, loss_fn)
    ladders = placements(model, batch)
    ck_peaks = {p: peak(checkpointed(model, p).train(), batch, loss_fn) for ladder in ladders.values() for p in ladder}
    print(f"{args.model} b{args.batch}: stock peak {stock_peak / MIB:.1f} MiB; checkpoint placements: "
          + "; ".join(f"per {k}: {len(v)}, peaks {min(ck_peaks[p] for p in v) / stock_peak:.3f}-"
                      f"{max(ck_peaks[p] for p in v) / stock_peak:.3f}x" for k, v in ladders.items()), flush=True)
    rows = []
    for fraction in args.exact:
        budget = int(fraction * stock_peak)
        row: dict = {"fraction": fraction, "budget_mib": budget / MIB, "stock_peak_mib": stock_peak / MIB}
        timed: dict[str, nn.Module] = {}
        if args.baselines_only:
            row["exact"] = row["lossy"] = NOT_MEASURED
        for fidelity in () if args.baselines_only else ("exact", "lossy"):
            try:
                fitted = lessmem.fit(model, batch, budget, optimizer=sgd, loss_fn=loss_fn, fidelity=fidelity,
                                     max_step_ratio=args.max_step_ratio)
            except lessmem.sensitivity.NoFit as e:
                row[fidelity] = str(e)
                continue
            timed[fidelity] = lessmem.compress(copy.deepcopy(model).train(), fitted.plan)
            grads = grads_of(timed[fidelity], batch, loss_fn)  # before the timed steps move the weights
            row.update({f"{fidelity}_peak_ratio": fitted.step_peak_bytes / stock_peak,
                        f"{fidelity}_max_rel_grad_error": max_relative_error(grads, reference)})
            if fidelity == "lossy":
                row.update(lossy_tensor_error=fitted.score.get("tensor_error", 0.0),
                           lossy_recomputed=len(fitted.plan.recompute))
            if fidelity == "exact":
                row.update(exact_fit_step_ratio=fitted.step_time_ratio,
                           exact_max_elementwise_error=max_elementwise_error(grads, reference),
                           recomputed=len(fitted.plan.recompute), floor_ratio=fitted.floor_step_peak_bytes / stock_peak)
        fitting = fitting_placements(ladders, ck_peaks, budget)
        if not fitting:
            row["checkpoint"] = f"none fits (floor {min(ck_peaks.values()) / stock_peak:.3f}x)"
        timed |= {f"checkpoint {i}": checkpointed(model, p).train() for i, p in enumerate(fitting)}
        if not args.no_compile:
            target = min(1.0, max(0.0, (budget - static) / (stock_peak - static)))
            timed["compile"] = compiled_budget(model, target).train()
            error = max_relative_error(grads_of(timed["compile"], batch, loss_fn), reference)  # its first call compiles
            row.update(compile_fraction=target, compile_peak_ratio=peak(timed["compile"], batch, loss_fn) / stock_peak,
                       compile_max_rel_grad_error=error)
        ratios = dict(zip(timed, step_ratios(copy.deepcopy(model).train(), list(timed.values()), batch, loss_fn,
                                             args.steps, args.clock), strict=True))
        for kind in ("exact", "lossy", "compile"):
            if kind in ratios:
                row[f"{kind}_step_ratio"] = ratios[kind]
        if fitting:
            i, best = min(enumerate(fitting), key=lambda ip: ratios[f"checkpoint {ip[0]}"])
            row.update(checkpoint_ladder=next(k for k, v in ladders.items() if best in v), checkpoint_units=len(best),
                       checkpoint_peak_ratio=ck_peaks[best] / stock_peak, checkpoint_step_ratio=ratios[f"checkpoint {i}"])
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)
    print(exact_table(rows))


def exact_table(rows: list[dict]) -> str:
    """The exact view's rows as a markdown table (ratios to stock's peak and step)."""
    def cell(r: dict, key: str, spec: str = ".3f", suffix: str = "") -> str:
        return f"{float(r[key]):{spec}}{suffix}" if r.get(key) not in (None, "") else ""

    lines = ["| budget | exact peak | exact step | exact grad error | regions | checkpoint peak | checkpoint step "
             "| checkpoint units | compiled fraction | compiled peak | compiled step | compiled grad error "
             "| lossy peak | lossy step | lossy grad error | lossy regions |", "|" + "---:|" * 16]
    for r in rows:
        exact_peak = cell(r, "exact_peak_ratio")
        if not exact_peak and (floor := re.search(r"peaks at ([\d.]+)MiB", r.get("exact", ""))):
            exact_peak = f"none (floor {float(floor[1]) / float(r['stock_peak_mib']):.3f})"
        if r.get("exact") == NOT_MEASURED:
            exact_peak = "not measured"
        lossy_peak = "not measured" if r.get("lossy") == NOT_MEASURED else cell(r, "lossy_peak_ratio") or "none fits"
        units = f"{r['checkpoint_units']} {r['checkpoint_ladder']}" if r.get("checkpoint_units") else "none fits"
        lines.append(f"| {float(r['fraction']):.2f}x | {exact_peak} | {cell(r, 'exact_step_ratio', '.2f', 'x')} "
                     f"| {cell(r, 'exact_max_rel_grad_error', '.1e')} | {r.get('recomputed', '')} "
                     f"| {cell(r, 'checkpoint_peak_ratio')} | {cell(r, 'checkpoint_step_ratio', '.2f', 'x')} | {units} "
                     f"| {cell(r, 'compile_fraction', '.2f')} | {cell(r, 'compile_peak_ratio')} "
                     f"| {cell(r, 'compile_step_ratio', '.2f', 'x')} | {cell(r, 'compile_max_rel_grad_error', '.1e')} "
                     f"| {lossy_peak} | {cell(r, 'lossy_step_ratio', '.2f', 'x')} "
                     f"| {cell(r, 'lossy_max_rel_grad_error', '.1e')} | {r.get('lossy_recomputed', '')} |")
    return "\n".join(lines)


def plot_exact(paths: list[str], out: str) -> None:
    """Per CSV of the exact view, one panel: whole-step peak (x stock's) against the budget for the
    exact plan, the lossy plan, the fastest checkpoint placement that fits and the compiled step,
    each point labelled with its step time."""
    import matplotlib.pyplot as plt

    kinds = (("exact", "o-", "lessmem exact"), ("lossy", "s--", "lessmem lossy"),
             ("checkpoint", "^-.", "torch.utils.checkpoint (fastest fitting placement)"),
             ("compile", "d:", "torch.compile activation_memory_budget"))
    fig, axes = plt.subplots(1, len(paths), figsize=(4.8 * len(paths), 4.4), squeeze=False)
    for ax, path in zip(axes[0], paths, strict=True):
        with open(path, newline="") as f:
            rows = [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
        print(f"{path}:\n{exact_table(rows)}")
        budgets = [float(r["fraction"]) for r in rows]
        ax.plot(budgets, budgets, "k:", lw=0.8, label="budget")
        for i, (kind, marker, label) in enumerate(kinds):
            points = [(float(r["fraction"]), float(r[f"{kind}_peak_ratio"]), float(r[f"{kind}_step_ratio"]))
                      for r in rows if f"{kind}_peak_ratio" in r]
            if points:
                line, = ax.plot([b for b, _, _ in points], [q for _, q, _ in points], marker, label=label)
                for b, q, t in points:
                    ax.annotate(f"{t:.2f}x", (b, q), textcoords="offset points", xytext=(4, 6 - 6 * i),
                                fontsize=6, color=line.get_color())
        ax.set(xlabel="budget (x stock's whole-step peak)", ylabel="measured peak (x stock's)",
               title=os.path.basename(path).removesuffix(".csv"))
        ax.invert_xaxis()
        ax.legend(fontsize=6)
    fig.suptitle("Exact under a budget: peak, step time over stock's beside each point")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def curve(model: nn.Module, batch, loss_fn, profile, args: argparse.Namespace) -> None:
    """The profile's peak model (floor, bend map, stock) against the measured peak of maps spread
    evenly in saved bytes between the floor and stock (the knapsack's, default criterion)."""
    least, stock = profile.floor_map.score["bytes"], profile.menu.stock_bytes
    errors = []
    for i in range(1, args.curve + 1):
        choice = profile.menu.make_map(least + (stock - least) * i / (args.curve + 1))
        net = lessmem.compress(copy.deepcopy(model).train(), choice.plan)
        saved, measured = choice.score["bytes"], peak(net, batch, loss_fn)
        predicted = profile.peaks.predict(saved)
        errors.append(predicted / measured - 1)
        print(f"saved {saved / MIB:8.2f} MiB  measured peak {measured / MIB:8.2f}  predicted {predicted / MIB:8.2f} "
              f"({100 * errors[-1]:+.1f}%)", flush=True)
    print(f"profile points (saved, peak MiB): {[(round(s / MIB, 2), round(q / MIB, 2)) for s, q in profile.peaks.points]}; "
          f"prediction error {100 * min(errors):+.1f}% to {100 * max(errors):+.1f}%")


def plan(profile, budget: int, args: argparse.Namespace) -> None:
    """The planning view (``lessmem-plan`` for a run's config): predictions, not measured steps."""
    rows = plan_batches(profile, budget)
    for r in rows:
        err = "nothing fits" if not r.fits else f"grad_error {r.grad_error:.4f} cosine {r.cosine:.4f}"
        print(f"batch {r.batch_size:5d}: predicted peak {r.predicted_peak_bytes / MIB:9.1f} MiB  {err}")
    if args.plot:
        plot_batch_plan([dataclasses.asdict(r) for r in rows], budget, args.plot,
                        f"{args.model}: best map within {format_bytes(budget)}")


if __name__ == "__main__":
    main()
