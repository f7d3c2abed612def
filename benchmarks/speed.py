"""Training-step time of a compressed model against stock PyTorch, on the same batch.

Both models live in one process and run alternately (stock, compressed, stock, ...) so that
machine noise hits both alike; the reported ratio is median(compressed) / median(stock).

    python benchmarks/speed.py --model resnet18 --batch 32 --size 224 --kernels 2 4
    python benchmarks/speed.py --model resnet18 --size 64 --batch 16 --maps 2 int8 int4 2/int4
    python benchmarks/speed.py --compile          # torch.compile both (compile time not timed)
    python benchmarks/speed.py --model resnet20 --size 32 --batch 128 --channels-last
    python benchmarks/speed.py --model resnet18 --size 64 --batch 16 --profile 2   # the ops that moved most
    python benchmarks/speed.py --maps 2/int4 --profile 2x2/int4 --profile-rounds 5   # a --maps config's
    python benchmarks/speed.py --threads 1 --clock cpu    # CPU time: steadier on a shared machine
    python benchmarks/speed.py --maps int2 --norm-storage int4    # a low-bit map, BatchNorm in int4
    python benchmarks/speed.py --maps int2 'layer*.conv2:from_bn,*:int2' --norm-storage int4   # a whole map
    python benchmarks/speed.py --model resnet20 --size 32 --batch 128 --threads 1 --clock cpu \
        --map-file joint_0.08.yaml   # a plan file, its storages too (docs/results/speed.md: issue 42)
    python benchmarks/speed.py --model tiny_llama --seq 256 --batch 8 --optimizer adamw --maps int8 \
        --norm-storage int8 --act-storage int8 --saved-storage int8 --threads 1 --clock cpu  # lossy_int8

Models: torchvision names and lessmem's registry (resnet20, resnet18_cifar, ...). ``--kernels K``
times the map {"*": K}; ``--maps SPEC`` times {"*": SPEC} for a spec string of ``lessmem.compress``
(``k``, ``k/storage``, ``khxkw/storage`` or a storage alone, storages native, bf16, int8, int4,
int2, int1), named in the table as ``LayerSpec`` prints it (``2x2/int4``; ``int8`` is ``1x1/int8``).
``--map-file FILE`` times the plan in a map file (``lessmem.CompressionPlan.read``: its map and its
storages; the ``--*-storage`` options do not apply to it), named by the plan's label.
Without ``--maps`` or ``--map-file``, ``--kernels`` defaults to 2 4.
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torchvision

import lessmem
from lessmem.core import alternating_step_times, parse_spec
from lessmem.core.storage import STORAGES
from lessmem.experiment.compression import parse_map_string

VOCAB = 256  # token ids of the causal-LM models (--seq)
CLOCKS = {
    "wall": time.perf_counter,
    "cpu": time.process_time,
    "user": lambda: resource.getrusage(resource.RUSAGE_SELF).ru_utime,
}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def train_step(model, optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    out = model(x)
    torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--kernels", type=int, nargs="+", default=None,
                        help="pooling kernels k, each timed as the map {'*': k} (default 2 4 without --maps)")
    parser.add_argument("--maps", nargs="+", default=[], metavar="SPEC",
                        help="spec strings, each timed as the map {'*': SPEC}: e.g. 4/native int4 2/int4 int8; "
                             "or a whole map as PATTERN:SPEC,... ('layer*.conv2:from_bn,*:int2')")
    parser.add_argument("--map-file", nargs="+", default=[], metavar="FILE",
                        help="map files (CompressionPlan.read), each timed with its own storages")
    parser.add_argument("--norm-storage", default="native", choices=STORAGES,
                        help="BatchNorm input storage of every compressed config (int4 with --maps int2: the low-bit map)")
    parser.add_argument("--act-storage", default="native", choices=STORAGES,
                        help="GELU / SiLU input storage of every compressed config")
    parser.add_argument("--saved-storage", default="native", choices=STORAGES,
                        help="storage of every other saved tensor of every compressed config")
    parser.add_argument("--seq", type=int, default=None,
                        help=f"causal-LM models (tiny_llama, tiny_gpt2): token ids (batch, SEQ) of a {VOCAB}-token "
                             "vocabulary and the next-token loss, instead of images")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (all its threads), which "
                             "other processes on a shared CPU disturb far less (use with --threads 1: "
                             "idle OpenMP threads spin, and that counts too); user: its user time only, "
                             "without the kernel's (page faults, whose count swings between runs on a VM "
                             "that reclaims memory)")
    parser.add_argument("--compile", action="store_true", help="torch.compile stock and compressed models")
    parser.add_argument("--channels-last", action="store_true", help="NHWC model and input (oneDNN)")
    parser.add_argument("--profile", default=None, metavar="CONFIG",
                        help="also print the ops whose self CPU time per step moved most between stock and "
                             "CONFIG (K for KxK, or a config name of the table such as 2x2/int4)")
    parser.add_argument("--profile-rounds", type=int, default=3,
                        help="profiled rounds of stock and CONFIG, alternating; an op's time is its median over them")
    parser.add_argument("--profile-steps", type=int, default=1, help="steps in each profiled round")
    parser.add_argument("--profile-top", type=int, default=25, help="ops listed")
    args = parser.parse_args()
    specs = _specs(parser, args.kernels, args.maps, bool(args.map_file))
    plans = _plans(parser, args.map_file, specs)
    profiled = _profiled(parser, args.profile, [*specs, *plans])
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    stock = build(args.model, VOCAB if args.seq else 10)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    stock = stock.to(memory_format=fmt)
    models = {"stock": stock}
    for name, mapping in specs.items():
        models[name] = lessmem.compress(copy.deepcopy(stock), mapping, norm_storage=args.norm_storage,
                                        act_storage=args.act_storage, saved_storage=args.saved_storage)
    for name, plan in plans.items():
        models[name] = lessmem.compress(copy.deepcopy(stock), plan)
    optimizers = {n: OPTIMIZERS[args.optimizer](m.parameters()) for n, m in models.items()}
    if args.compile:
        models = {n: torch.compile(m) for n, m in models.items()}
    if args.seq:
        x = torch.randint(0, VOCAB, (args.batch, args.seq))
        y = torch.roll(x, -1, 1)
    else:
        x = torch.randn(args.batch, 3, args.size, args.size).contiguous(memory_format=fmt)
        y = torch.randint(0, 10, (args.batch,))

    clock = CLOCKS[args.clock]
    steps = [lambda m=m, o=optimizers[n]: train_step(m, o, x, y) for n, m in models.items()]
    times = dict(zip(models, alternating_step_times(steps, args.repeats, warmup=args.warmup, clock=clock),
                     strict=True))

    base = statistics.median(times["stock"])
    mode = "torch.compile" if args.compile else "eager"
    layout = ", channels-last" if args.channels_last else ""
    shape = f"{args.seq} tokens" if args.seq else f"{args.size}x{args.size}"
    print(f"{args.model}, {mode}{layout}, batch {args.batch}, {shape}, fp32, {args.optimizer}, "
          f"{torch.get_num_threads()} threads, {args.repeats} alternating steps each, {args.clock} clock, "
          f"torch {torch.__version__}")
    print("| config | median step (s) | min (s) | ratio to stock |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {min(ts):.3f} | {med / base:.3f} |")
    if profiled:
        step_of = dict(zip(models, steps, strict=True))
        profile_diff({n: step_of[n] for n in ("stock", profiled)}, args.profile_rounds, args.profile_steps,
                     args.profile_top)


def _specs(parser: argparse.ArgumentParser, kernels: list[int] | None, maps: list[str],
           map_files: bool = False) -> dict[str, dict]:
    """{table name: map} of the compressed configurations, kernels first, each once: a spec is the
    map {"*": spec}, named as its LayerSpec prints; a whole map (``PATTERN:SPEC,...``) is named as written."""
    default = [] if maps or map_files else [2, 4]
    values: list[object] = list(kernels if kernels is not None else default) + list(maps)
    specs: dict[str, dict] = {}
    for value in values:
        try:
            if isinstance(value, str) and ":" in value:
                specs.setdefault(value, parse_map_string(value))
            else:
                specs.setdefault(str(parse_spec("*", value)), {"*": value})
        except ValueError as e:
            parser.error(f"--{'kernels' if isinstance(value, int) else 'maps'} {value}: {e}")
    return specs


def _plans(parser: argparse.ArgumentParser, files: list[str], specs: dict[str, dict]) -> dict[str, lessmem.CompressionPlan]:
    """{table name: plan} of the ``--map-file`` configurations, named by their labels."""
    plans: dict[str, lessmem.CompressionPlan] = {}
    for file in files:
        try:
            plan = lessmem.CompressionPlan.read(file)
        except (OSError, ValueError) as e:
            parser.error(f"--map-file {file}: {e}")
        if plan.label in specs or plan.label in plans:
            parser.error(f"--map-file {file}: a configuration named {plan.label!r} is timed already")
        plans[plan.label] = plan
    return plans


def _profiled(parser: argparse.ArgumentParser, profile: str | None, specs: list[str]) -> str | None:
    """The configuration ``--profile`` names (K stands for KxK), checked against the table's."""
    if profile is None:
        return None
    name = f"{profile}x{profile}" if profile.isdigit() else profile
    if name not in specs:
        parser.error(f"--profile {profile}: no configuration {name!r} is timed; choose one of {', '.join(specs)}")
    return name


def build(name: str, num_classes: int) -> torch.nn.Module:
    from lessmem.models import MODELS, build_model

    if name in MODELS:
        return build_model(name, num_classes=num_classes)
    return getattr(torchvision.models, name)(num_classes=num_classes)


def profile_diff(steps: dict[str, Callable[[], object]], rounds: int, per_round: int, top: int) -> None:
    """The ops whose self CPU time per step differs most between the two ``steps`` (stock first):
    profiled in alternating rounds of ``per_round`` steps each, every op's time and calls per step
    the median over rounds, so that machine drift hits both alike. Calls per step in parentheses."""
    from torch.profiler import ProfilerActivity, profile

    profiled: dict[str, list[dict[str, tuple[float, float]]]] = {n: [] for n in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(per_round):
                    step()
            profiled[name].append({e.key: (e.self_cpu_time_total / 1000 / per_round, e.count / per_round)
                                   for e in prof.key_averages()})
    per_op = {name: {key: tuple(statistics.median(r.get(key, (0.0, 0.0))[i] for r in runs) for i in (0, 1))
                     for key in set().union(*runs)} for name, runs in profiled.items()}
    (stock, a), (name, b) = per_op.items()
    rows = sorted(a.keys() | b.keys(), key=lambda k: -abs(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]))
    print(f"\n### self CPU ms per step, {name} against {stock} (median of {rounds} rounds x {per_round} steps; "
          "calls per step)\n")
    print(f"total: {stock} {sum(t for t, _ in a.values()):.1f}, {name} {sum(t for t, _ in b.values()):.1f}")
    for k in rows[:top]:
        (ta, ca), (tb, cb) = a.get(k, (0.0, 0.0)), b.get(k, (0.0, 0.0))
        print(f"{tb - ta:+8.2f}  {k[:55]:55s} {stock} {ta:7.2f} ({ca:4.0f})  {name} {tb:7.2f} ({cb:4.0f})")


if __name__ == "__main__":
    main()
