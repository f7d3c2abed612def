"""How long a context fits: the longest sequence whose whole LoRA training step (batch 1, forward,
backward, AdamW on the adapters) peaks within each memory budget, for a ~135M-parameter
Llama-architecture model (SmolLM-135M's shape: hidden 576, 30 layers, 9 heads / 3 key-value heads,
MLP 1536, vocabulary 49,152, tied embeddings; random init) in bfloat16 with LoRA r 16 on all seven
projections (issue 45).

Configurations, each on the model's own HF loss (``model(input_ids, labels=...)``):
  hf                             stock
  hf_checkpointing               ``gradient_checkpointing_enable()`` (non-reentrant)
  hf_checkpointing_chunked_loss  the same with ``lessmem.integrations.hf.use_chunked_loss`` (what the
                                 loss alone is worth)
  lessmem_lossy                  the plan ``lessmem.fit(memory_budget=...)`` gives at the longest
                                 length that fits (the floor of its menu, measured at --probe-length),
                                 with the chunked loss; with --lossy-ratio R, the menu's knapsack map at
                                 R x stock's saved bytes instead (row ``lessmem_lossy_<R>x``: what fits a
                                 shorter context, at less cost than the floor)
  lessmem_exact                  the same for ``fit(fidelity="exact")`` (its exact floor), chunked loss

Per configuration, whole-step peaks at two lengths give a line; per budget its predicted longest length
(a multiple of --granularity) is verified by a real step, and moved down by the overshoot until one fits
(the next length up is predicted over). A peak is the bytes of the tensors alive before the step
(parameters, optimizer state, batch) plus the growth of the resident set during it
(``lessmem.core.peak_rss_growth``), each step in a fresh process started with glibc's mmap threshold
fixed (``FIXED_MMAP_ENV``) and holding the model alone: there every block above the threshold is mapped
when allocated and unmapped when freed, so the resident set tracks live bytes; in a process whose heap
holds freed chunks (one that ran the profiler) it read up to 23% low (docs/results/budget.md). Torch's
profiler (``lessmem.measure_step_memory``; --measure profiler for tiny models) needs some 10 GB of its
own at 2,048 tokens here; its peak at the first length, in a process of its own, is printed beside as a
cross-check. Step time: every configuration at --time-length, steps taking
turns (process CPU time), over HF stock's and HF checkpointing's. Gradient error: the LoRA gradients'
largest relative difference to HF stock's at --probe-length, each model after its own warm-up step
(the one that makes the optimizer state).

    python benchmarks/context.py --csv docs/results/budget/context.csv --plot docs/results/budget/context.png
    python benchmarks/context.py --plot-only docs/results/budget/context.csv --plot docs/results/budget/context.png
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from lessmem.core import (
    FIXED_MMAP_ENV,
    CompressionPlan,
    alternating_step_times,
    compress,
    measure_step_memory,
    peak_rss_growth,
    training_step,
)
from lessmem.integrations.hf import model_loss, use_chunked_loss
from lessmem.integrations.schedule import BatchCall, output_is_loss
from lessmem.sensitivity import budget_profile, format_bytes, parse_bytes
from lessmem.sensitivity.exact_fit import exact_ladder

MIB = 2**20
SHAPES = {
    "smollm_135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = ("hf", "hf_checkpointing", "hf_checkpointing_chunked_loss", "lessmem_lossy", "lessmem_exact")
MAX_STEPS = 4  # verification steps per budget


def build(shape: str, max_length: int, seed: int) -> nn.Module:
    """The bfloat16 model with LoRA r 16 (float32 adapters, as PEFT makes them)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_length, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS)).train()


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4)


def batch_of(model: nn.Module, length: int, seed: int = 0) -> tuple[BatchCall, tuple[torch.Tensor, torch.Tensor]]:
    """One sequence of ``length`` random tokens as its own labels, and the model's loss on it."""
    vocab = model.get_input_embeddings().num_embeddings
    tokens = torch.randint(vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return BatchCall(model, ((), {"input_ids": tokens, "labels": tokens}), model_loss), (tokens, tokens)


class Setup:
    """One configuration's model and optimizer, its optimizer state made by a short step."""

    def __init__(self, name: str, args: argparse.Namespace, plans: dict[str, CompressionPlan]) -> None:
        self.name = name
        self.model = build(args.shape, args.max_length, args.seed)
        if name.startswith("hf_checkpointing"):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if name != "hf" and name != "hf_checkpointing":
            use_chunked_loss(self.model)
        if name in plans:
            compress(self.model, plans[name])
        self.optimizer = adamw(self.model.parameters())
        self.step(64)

    def step(self, length: int) -> None:
        call, batch = batch_of(self.model, length)
        training_step(call, batch, self.optimizer, output_is_loss)

    def resident_peak(self, length: int) -> int:
        """The step's peak in this process: the bytes of the tensors alive before it (parameters,
        optimizer state, the batch) plus the growth of the resident set during it."""
        call, batch = batch_of(self.model, length)
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        static = sum(t.untyped_storage().nbytes() for t in [*self.model.parameters(), *state, batch[0]])
        return static + peak_rss_growth(lambda: training_step(call, batch, self.optimizer, output_is_loss))

    def profiled_peak(self, length: int) -> int:
        """The same step's peak by torch's profiler (CPU tensor allocations), for a cross-check."""
        call, batch = batch_of(self.model, length)
        return measure_step_memory(call, batch, optimizer=self.optimizer, loss_fn=output_is_loss, warmup_steps=0,
                                   live=False).peak_bytes


def release_freed_heap() -> None:
    """Give the pages of freed heap memory back to the system: this process profiled steps (lessmem's
    plans), which leaves gigabytes freed but held in glibc's heap (11 GB here, enough to get the
    machine's OOM killer to stop the run while a child measured)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def fresh_peak(name: str, length: int, args: argparse.Namespace, plan_file: str | None, measure: str = "rss") -> int:
    """``Setup.resident_peak`` (``Setup.profiled_peak``: ``measure="profiler"``) of configuration
    ``name`` at ``length`` tokens in a fresh process started with ``FIXED_MMAP_ENV``, the plan
    (lessmem's configurations) read from ``plan_file``."""
    release_freed_heap()
    command = [sys.executable, __file__, "--peak-of", name, "--at", str(length), "--measure", measure, "--shape", args.shape,
               "--max-length", str(args.max_length), "--seed", str(args.seed), "--threads", str(args.threads),
               *(["--plan-file", plan_file] if plan_file else [])]
    done = subprocess.run(command, env=os.environ | FIXED_MMAP_ENV, capture_output=True, text=True)
    if done.returncode != 0:
        killed = " (killed: out of the machine's memory?)" if done.returncode < 0 else ""
        raise RuntimeError(f"the step of {name} at {length} tokens failed in its own process{killed}:\n{done.stderr[-2000:]}")
    return int(done.stdout.split()[-1])


def lessmem_plans(args: argparse.Namespace) -> dict[str, CompressionPlan]:
    """What ``lessmem.fit`` reaches at its floor, measured at --probe-length with the chunked loss:
    the lossy menu's smallest map, and the lower of the exact ladders' floors."""
    model = use_chunked_loss(build(args.shape, args.max_length, args.seed))
    call, batch = batch_of(model, args.probe_length)
    started = time.perf_counter()
    profile = budget_profile(call, batch, optimizer=adamw, loss_fn=output_is_loss)
    assert profile.menu is not None and profile.floor_map is not None
    lossy = profile.menu.make_map(args.lossy_ratio) if args.lossy_ratio else profile.floor_map
    # short blocks: the resident set reuses freed pages, so the floors are read with the profiler
    ladder = exact_ladder(call, batch[0], 1.0, lambda plan: Setup("probe", args, {"probe": plan}).profiled_peak(args.probe_length))
    exact = ladder.plans[-1]
    print(f"plans measured at {args.probe_length} tokens in {time.perf_counter() - started:.0f} s: lossy "
          f"{f'map at {args.lossy_ratio}x' if args.lossy_ratio else 'floor'} saves "
          f"{lossy.score['bytes'] / MIB:.1f} MiB (predicted gradient error {lossy.score.get('grad_error', 0):.3f}); exact floor "
          f"{'plain checkpointing' if ladder.bare else 'lessmem ladder'} "
          f"({len(exact.recompute)} regions recomputed), step peak {format_bytes(ladder.floor_peak)}", flush=True)
    return {"lessmem_lossy": lossy.plan, "lessmem_exact": exact}


def row_name(name: str, args: argparse.Namespace) -> str:
    return f"{name}_{args.lossy_ratio}x" if name == "lessmem_lossy" and args.lossy_ratio else name


def longest(name: str, peak: Callable[[int], int], budget: int, points: dict[int, int], args: argparse.Namespace) -> dict:
    """The longest length (a multiple of the granularity) whose peak, verified by ``peak``, fits ``budget``."""
    granularity, best, over = args.granularity, None, math.inf
    for _ in range(MAX_STEPS):
        near = sorted(points, key=lambda n: abs(points[n] - budget))[:2]
        (n0, p0), (n1, p1) = sorted((n, points[n]) for n in near)
        slope = (p1 - p0) / (n1 - n0)
        guess = int((n0 + (budget - p0) / slope) // granularity * granularity) if slope > 0 else args.cap
        guess = max(granularity, min(guess, args.cap, over - granularity))
        if best is not None and guess <= best:
            break
        if guess not in points:  # a length verified for a smaller budget needs no second step
            started = time.perf_counter()
            points[guess] = peak(guess)
            print(f"  {name} at {guess} tokens: peak {format_bytes(points[guess])} (budget {format_bytes(budget)}, "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)
        if points[guess] <= budget:
            best = guess
            if guess == args.cap or guess + granularity >= over:
                break
        else:
            over = guess
    if best is None:
        return {"config": name, "budget_bytes": budget, "length": 0, "peak_bytes": "", "next_over": over}
    return {"config": name, "budget_bytes": budget, "length": best, "peak_bytes": points[best],
            "next_over": over if over < math.inf else "", "capped": best == args.cap}


def gradient_errors(args: argparse.Namespace, plans: dict[str, CompressionPlan]) -> dict[str, float]:
    """Per configuration, the LoRA gradients' largest relative difference to HF stock's."""
    def grads(name: str) -> list[torch.Tensor]:
        setup = Setup(name, args, plans)
        call, batch = batch_of(setup.model, args.probe_length, seed=1)
        setup.model.zero_grad(set_to_none=True)
        output_is_loss(call(batch[0]), batch[1]).backward()
        return [p.grad.float() for p in setup.model.parameters() if p.grad is not None]

    reference = grads("hf")
    return {name: max(float((g - r).norm() / r.norm()) for g, r in zip(grads(name), reference, strict=True))
            for name in args.configs if name != "hf"} | {"hf": 0.0}


def step_times(setups: list[Setup], args: argparse.Namespace) -> dict[str, float]:
    """Median step seconds of every configuration at --time-length, steps taking turns."""
    steps: list[Callable[[], object]] = []
    for setup in setups:
        call, batch = batch_of(setup.model, args.time_length)
        steps.append(lambda c=call, b=batch, o=setup.optimizer: training_step(c, b, o, output_is_loss))
    times = alternating_step_times(steps, args.repeats, clock=time.process_time)
    return {s.name: statistics.median(t) for s, t in zip(setups, times, strict=True)}


def table(rows: list[dict], budgets: list[int]) -> str:
    """Markdown: per configuration, the longest length per budget (its verified peak; "edge": over
    the budget if the peak read as low against the profiler's as at the cross-check length), the
    peak measure against the profiler's, step time, gradient error."""
    head = ["configuration", *(f"{format_bytes(b)}" for b in budgets), "measure / profiler", "step time",
            "gradient error"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = {int(r["budget_bytes"]): r for r in rows if r["config"] == name}
        first = next(iter(mine.values()))
        known = first.get("measured_peak_at_profiled_length") not in (None, "")
        reads = float(first["measured_peak_at_profiled_length"]) / float(first["profiled_peak_bytes"]) if known else 1.0
        cells = []
        for b in budgets:
            r = mine.get(b)
            if r is None or not int(r["length"]):
                cells.append("none" if r is not None else "")
                continue
            capped = "≥ " if str(r.get("capped")) == "True" else ""
            edge = ", edge" if float(r["peak_bytes"]) / min(reads, 1.0) > b else ""
            cells.append(f"{capped}{int(r['length'])} ({float(r['peak_bytes']) / MIB:.0f} MiB{edge})")
        versus = f"{reads:.3f} at {first['profiled_length']}" if known else ""
        timing = ""
        if first.get("step_s") not in (None, ""):
            vs_ckpt = float(first["step_vs_checkpointing"])
            timing = (f"{float(first['step_s']):.3g} s, {float(first['step_vs_hf']):.2f}x HF"
                      + ("" if math.isnan(vs_ckpt) else f", {vs_ckpt:.2f}x ckpt"))
        error = f"{float(first['grad_error']):.1e}" if first.get("grad_error") not in (None, "") else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {versus} | {timing} | {error} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: str) -> None:
    """Grouped bars: tokens per budget per configuration, each labelled with its step time."""
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["config"] for r in rows))
    budgets = sorted({int(r["budget_bytes"]) for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4.4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        mine = {int(r["budget_bytes"]): r for r in rows if r["config"] == name}
        lengths = [int(mine[b]["length"]) if b in mine else 0 for b in budgets]
        capped = [b in mine and str(mine[b].get("capped")) == "True" for b in budgets]
        step = next(iter(mine.values())).get("step_vs_hf")
        label = f"{name} ({float(step):.2f}x HF's step)" if step not in (None, "") else name
        bars = ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(budgets))], lengths, width, label=label)
        ax.bar_label(bars, labels=[("≥" if c else "") + str(n) if n else "not measured" for n, c in zip(lengths, capped, strict=True)],
                     fontsize=6)
    ax.set_xticks(range(len(budgets)), [format_bytes(b) for b in budgets])
    ax.set(xlabel="whole-step memory budget", ylabel="longest sequence that fits (tokens, verified)",
           title="LoRA r16 on a 135M Llama (bf16, batch 1): context per budget")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", nargs="+", default=["1GiB", "2GiB", "4GiB"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--shape", default="smollm_135m", choices=sorted(SHAPES))
    p.add_argument("--lengths", nargs=2, type=int, default=[512, 1024], help="the two lengths each line starts from")
    p.add_argument("--probe-length", type=int, default=256, help="lessmem's plans and the gradient check")
    p.add_argument("--lossy-ratio", type=float, help="lessmem_lossy: the menu's map at this fraction of stock's "
                   "saved bytes, not fit's floor")
    p.add_argument("--time-length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--measure", default="rss", choices=["rss", "profiler"],
                   help="how a step's peak is read (profiler: tiny models; it needs gigabytes of its own at long lengths)")
    p.add_argument("--time-only", action="store_true", help="the step times alone (and the gradient errors)")
    p.add_argument("--granularity", type=int, default=64)
    p.add_argument("--cap", type=int, default=16384, help="the longest length tried")
    p.add_argument("--max-length", type=int, default=32768, help="the model's max_position_embeddings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--csv")
    p.add_argument("--plot")
    p.add_argument("--plot-only", help="a CSV this script wrote: print its table and plot it, measure nothing")
    p.add_argument("--peak-of", choices=CONFIGS, help=argparse.SUPPRESS)  # a fresh process's one step (fresh_peak)
    p.add_argument("--at", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plan-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peak_of:
        torch.set_num_threads(args.threads)
        plans = {args.peak_of: CompressionPlan.read(args.plan_file)} if args.plan_file else {}
        setup = Setup(args.peak_of, args, plans)
        print(setup.resident_peak(args.at) if args.measure == "rss" else setup.profiled_peak(args.at))
        return
    if args.plot_only:
        with open(args.plot_only, newline="") as f:
            rows = list(csv.DictReader(f))
        print(table(rows, sorted({int(r["budget_bytes"]) for r in rows})))
        if args.plot:
            plot(rows, args.plot)
        return
    torch.set_num_threads(args.threads)
    budgets = sorted(parse_bytes(b) for b in args.budgets)
    plans = lessmem_plans(args) if any(c.startswith("lessmem") for c in args.configs) else {}
    errors = gradient_errors(args, plans)
    setups = [Setup(name, args, plans) for name in args.configs]
    timed = step_times(setups, args)
    print(f"step seconds at {args.time_length} tokens: {timed}", flush=True)
    if args.time_only:
        print(" | ".join(f"{name} {t / timed['hf']:.2f}x HF" + (f", {t / timed['hf_checkpointing']:.2f}x ckpt"
                                                              if "hf_checkpointing" in timed else "")
                         for name, t in timed.items() if "hf" in timed))
        return
    rows = []
    plan_dir = tempfile.TemporaryDirectory()
    plan_files = {name: str(plan.write(os.path.join(plan_dir.name, f"{name}.yaml"))) for name, plan in plans.items()}
    del setups  # the peaks: in processes of their own (the profiler's gigabytes too), or on a new setup each
    for name in args.configs:
        if args.measure == "rss":
            peak = partial(fresh_peak, name, args=args, plan_file=plan_files.get(name))
            profiled = fresh_peak(name, args.lengths[0], args, plan_files.get(name), measure="profiler")
        else:
            peak = Setup(name, args, plans).profiled_peak
            profiled = peak(args.lengths[0])
        points = {n: peak(n) for n in args.lengths}
        print(f"{name}: peaks {[format_bytes(v) for v in points.values()]} at {list(points)} tokens (the "
              f"profiler's at {args.lengths[0]}: {format_bytes(profiled)})", flush=True)
        for budget in budgets:
            row = longest(row_name(name, args), peak, budget, points, args)
            row |= {"profiled_peak_bytes": profiled, "profiled_length": args.lengths[0],
                    "measured_peak_at_profiled_length": points[args.lengths[0]], "step_s": timed[name],
                    "step_vs_hf": timed[name] / timed.get("hf", math.nan),
                    "step_vs_checkpointing": timed[name] / timed.get("hf_checkpointing", math.nan),
                    "time_length": args.time_length, "grad_error": errors[name]}
            rows.append(row)
            if args.csv:
                with open(args.csv, "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
                    writer.writeheader()
                    writer.writerows(rows)
    print(table(rows, budgets))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
