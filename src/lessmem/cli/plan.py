"""``lessmem-plan [hydra overrides]``: what a larger batch costs under a memory budget.

    lessmem-plan model=resnet18 dataset=synthetic dataset.image_size=224 batch_size=32 memory_budget=4GiB
    lessmem-plan experiment=lm_quick memory_budget=150MiB plan.factors=[1,2,4]

The config is ``conf/plan.yaml`` (the training config plus ``plan.*``). One profile of the run's
model, first batch of ``batch_size``, optimizer, loss, precision and device (what
``lessmem-train memory_budget=...`` measures, from the same cache); then for batch sizes from
stock's largest within the budget up to 8x it, the best map's predicted whole-step peak and
whole-gradient error. Writes the table, ``plan.csv``, ``plan.json`` and ``plan.png`` to
``out_dir`` (default ``outputs/plan/<model>_b<batch>_<budget>``). Predictions, not measured steps:
``lessmem-train batch_size=N memory_budget=...`` measures the chosen map's step before training.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
from collections.abc import Sequence

from omegaconf import open_dict

from lessmem.cli.errors import command_args, exit_on_user_error
from lessmem.experiment import compose_config, plan_for_config
from lessmem.reporting import MiB, plot_batch_plan


def main(argv: Sequence[str] | None = None) -> int:
    argv = command_args(argv, __doc__)
    if argv is None:
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the profile's progress (lessmem.fit)
    with exit_on_user_error("lessmem-plan"):
        cfg = compose_config(argv, "plan")
        if not cfg.get("out_dir"):
            with open_dict(cfg):
                cfg.out_dir = f"outputs/plan/{cfg.model.name}_b{cfg.batch_size}_{cfg.get('memory_budget')}"
        spec, budget, rows = plan_for_config(cfg, tuple(float(f) for f in cfg.plan.factors))
    records = [dataclasses.asdict(r) for r in rows]
    title = f"{cfg.model.name}: memory_budget={spec.memory_budget} ({budget / MiB:.1f} MiB)"
    print(title)
    print("| batch | fits | predicted peak MiB | of budget | predicted grad error | cosine |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        err = "" if r.grad_error is None else f"{r.grad_error:.3g}"
        cos = "" if r.cosine is None else f"{r.cosine:.5f}"
        print(f"| {r.batch_size} | {'yes' if r.fits else 'no'} | {r.predicted_peak_bytes / MiB:.1f} | "
              f"{r.predicted_peak_bytes / budget:.3f} | {err} | {cos} |")
    out = spec.out_dir
    with open(out / "plan.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    (out / "plan.json").write_text(json.dumps({"memory_budget": spec.memory_budget, "memory_budget_bytes": budget,
                                               "model": cfg.model.name, "rows": records}, indent=1))
    plot_batch_plan(records, budget, out / "plan.png", title)
    print(f"wrote {out / 'plan.csv'}, plan.json, plan.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
