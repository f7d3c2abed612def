"""Per-op profile of a training step, stock against compressed, sorted by the difference.

Self CPU time per step (torch.profiler) of every op, for the stock model and for the same model
compressed with one kernel everywhere; the ops whose time moved most come first. The count in
parentheses is calls per step. Profiles alternate between the two models in rounds (``steps``
each) and every op's time is the median over rounds, so that machine drift hits both alike.

    python benchmarks/profile_diff.py 64 16 10 --rounds 5      # resnet18, 64 px, batch 16
    python benchmarks/profile_diff.py 224 32 2 --kernel 4 --model mobilenet_v2
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile

import lessmem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("size", type=int)
    parser.add_argument("batch", type=int)
    parser.add_argument("steps", type=int, help="profiled steps per round and model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--kernel", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    torch.manual_seed(0)
    stock = getattr(torchvision.models, args.model)(num_classes=10)
    name = f"{args.kernel}x{args.kernel}"
    models = {"stock": stock, name: lessmem.compress(copy.deepcopy(stock), {"*": args.kernel})}
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for n, m in models.items()}
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))

    def step(n: str) -> None:
        optimizers[n].zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(models[n](x), y).backward()
        optimizers[n].step()

    for n in models:
        for _ in range(3):  # warm-up: allocator, kernels built, oneDNN primitives cached
            step(n)
    rounds: dict[str, list[dict[str, tuple[float, float]]]] = {n: [] for n in models}
    for _ in range(args.rounds):
        for n in models:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    step(n)
            rounds[n].append({e.key: (e.self_cpu_time_total / args.steps / 1000, e.count / args.steps)
                              for e in prof.key_averages()})
    per_op = {n: collections.defaultdict(lambda: (0.0, 0.0)) for n in models}
    for n, runs in rounds.items():
        for key in set().union(*runs):
            times = [r.get(key, (0.0, 0.0)) for r in runs]
            per_op[n][key] = (statistics.median(t for t, _ in times), statistics.median(c for _, c in times))

    a, b = per_op["stock"], per_op[name]
    rows = sorted(set(a) | set(b), key=lambda k: -abs(b[k][0] - a[k][0]))
    print(f"{args.model}, {args.size} px, batch {args.batch}, median of {args.rounds} rounds x {args.steps} steps, "
          f"{torch.get_num_threads()} threads; self CPU ms per step (calls per step)")
    print(f"total: stock {sum(v[0] for v in a.values()):.1f}, {name} {sum(v[0] for v in b.values()):.1f}")
    for k in rows[: args.top]:
        print(f"{b[k][0] - a[k][0]:+7.2f}  {k[:55]:55s} stock {a[k][0]:6.2f} ({a[k][1]:4.0f})  "
              f"{name} {b[k][0]:6.2f} ({b[k][1]:4.0f})")


if __name__ == "__main__":
    main()
