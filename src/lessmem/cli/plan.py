"""``lessmem-plan [hydra overrides]``: what a larger batch costs under a memory budget.

    lessmem-plan model=resnet18 dataset=synthetic dataset.image_size=224 batch_size=32 memory_budget=4GiB
    lessmem-plan experiment=lm_quick memory_budget=150MiB plan.factors=[1,2,4] hydra.run.dir=DIR

The config is ``conf/plan.yaml`` (the training config plus ``plan.*``). One profile of the run's
model, first batch of ``batch_size``, optimizer, loss, precision and device (what
``lessmem-train memory_budget=...`` measures, from the same cache); then for batch sizes from
stock's largest within the budget up to 8x it, the best map's predicted whole-step peak and
whole-gradient error. Prints the table and writes ``plan.csv``, ``plan.json`` and ``plan.png`` to
Hydra's run dir (default ``outputs/plan/<model>_b<batch>_<budget>``, also set by ``out_dir=DIR``;
in a multirun each job's directory under ``hydra.sweep.dir``). Predictions, not measured steps:
``lessmem-train batch_size=N memory_budget=...`` measures the chosen map's step before training.
"""

from __future__ import annotations

import csv
import dataclasses
import json

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lessmem.cli.errors import hydra_entry, job_errors
from lessmem.experiment import conf_dir, plan_for_config
from lessmem.reporting import MiB, plot_batch_plan

PROG = "lessmem-plan"


@hydra.main(config_path=str(conf_dir()), config_name="plan", version_base="1.3")
def _plan(cfg: DictConfig) -> None:
    cfg.out_dir = HydraConfig.get().runtime.output_dir  # out_dir= only names the run dir's default (plan.yaml)
    with job_errors(PROG):
        spec, budget, rows, fitted = plan_for_config(cfg, tuple(float(f) for f in cfg.plan.factors))
    records = [dataclasses.asdict(r) for r in rows]
    title = f"{cfg.model.name}: memory_budget={spec.memory_budget} ({budget / MiB:.1f} MiB)"
    print(title)
    out = spec.out_dir
    if fitted is not None:
        ratio = "" if fitted.step_time_ratio is None else f", step time {fitted.step_time_ratio:.2f}x stock's"
        recomputed = ", ".join(fitted.plan.recompute) or "none"
        print(f"fidelity={spec.fidelity} at batch {fitted.batch_size}: {fitted.fidelity} plan {fitted.plan.label} "
              f"(recomputed: {recomputed}), whole-step peak {fitted.step_peak_bytes / MiB:.1f} MiB measured "
              f"({fitted.step_peak_bytes / budget:.3f} of the budget){ratio}")
        fitted.plan.write(out / f"{fitted.plan.name}.yaml", comment=f"lessmem-plan fidelity={spec.fidelity}")
        if fitted.regions:
            print("recomputable regions (most saved bytes per second of rerun first):")
            print("| region | saved MiB | rerun ms | recomputed |\n|---|---:|---:|---|")
            for r in fitted.regions:
                print(f"| {r.name} | {r.saved_bytes / MiB:.1f} | {1000 * r.seconds:.1f} | "
                      f"{'yes' if r.name in fitted.plan.recompute else 'no'} |")
    print("lossy maps by batch size (predicted):")
    print("| batch | fits | predicted peak MiB | of budget | predicted grad error | cosine | reruns' step |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        err = "" if r.grad_error is None else f"{r.grad_error:.3g}"
        cos = "" if r.cosine is None else f"{r.cosine:.5f}"
        print(f"| {r.batch_size} | {'yes' if r.fits else 'no'} | {r.predicted_peak_bytes / MiB:.1f} | "
              f"{r.predicted_peak_bytes / budget:.3f} | {err} | {cos} | {r.reruns_step_ratio:.2f}x |")
    with open(out / "plan.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    (out / "plan.json").write_text(json.dumps({"memory_budget": spec.memory_budget, "memory_budget_bytes": budget,
                                               "model": cfg.model.name, "rows": records,
                                               **({"fit": fitted.record() | {"plan": fitted.plan.to_dict(), "regions": [
                                                   dataclasses.asdict(r) for r in fitted.regions]}}
                                                  if fitted is not None else {})}, indent=1))
    plot_batch_plan(records, budget, out / "plan.png", title)
    print(f"wrote {out / 'plan.csv'}, plan.json, plan.png")


def main() -> None:
    """``lessmem-plan``: Hydra arguments; a bad setting (no ``memory_budget``) ends with one error
    line, exit 2."""
    hydra_entry(PROG, _plan)


if __name__ == "__main__":
    main()
