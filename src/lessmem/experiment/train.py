"""Training entry: ``run(cfg) -> metrics`` (used by the CLI, sweeps, search and tests).

Writes to the run's ``out_dir``: ``config.yaml`` (resolved), ``memory.json`` (saved-bytes
measurement, before the first epoch), ``metrics.jsonl`` (one line per epoch), ``checkpoint.pt``
(atomic), ``metrics.json`` (final, memory fields included), and ``grad_cosine.jsonl`` when enabled.
``run`` reads top-down: resolve the run's spec once (``spec``), build the model and its
compression (``compression``), data (``data``), measure (``probes``), optimizer and schedule
(``optim``), restore (``checkpoint``), then train epoch by epoch (``adaptive`` re-assigns kernels
on the way). SIGINT / SIGTERM stop it after the current step with a checkpoint
(``checkpoint.Interrupted``). ``lessmem.cli.train`` is the console entry.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lessmem.core import CompressionPlan
from lessmem.experiment.adaptive import adapt_compression
from lessmem.experiment.budget import choose_for_budget, with_budget_plan
from lessmem.experiment.checkpoint import (
    Checkpoints,
    Interrupted,
    Position,
    StopSignals,
    TrainState,
    checkpoint_to_resume,
    restore_checkpoint,
)
from lessmem.experiment.compression import compress_model, wrap_for_training
from lessmem.experiment.distributed import all_reduce_sum, teardown, unwrap
from lessmem.experiment.divergence import divergence_message, divergence_record, nonfinite_part
from lessmem.experiment.loggers import Logger, build_logger, epoch_line, write_coverage
from lessmem.experiment.probes import evaluate, first_batch, grad_cosine, measure
from lessmem.experiment.progress import with_progress
from lessmem.experiment.runtime import (
    atomic_write_text,
    autocast,
    epoch_seed,
    fault_point,
    seed_everything,
)
from lessmem.experiment.spec import RunSpec, resolve_run

log = logging.getLogger(__name__)

TIME_KEYS = ("epoch_time_s", "throughput_img_s", "throughput_tok_s", "train_time_s")  # differ between identical runs

EpochCallback = Callable[[int, dict[str, Any]], None]


def run(cfg: DictConfig, on_epoch_end: EpochCallback | None = None) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.dataset`` with ``cfg.compression``; returns the final metrics.

    ``on_epoch_end(epoch, record)`` is called on the main process after each epoch's evaluation
    and checkpoint (epoch counts from 1; ``record`` has ``val_top1`` etc., ``val_ppl`` for a language
    model: ``lessmem.experiment.task``). An exception it raises
    (e.g. ``optuna.TrialPruned``) ends the run after the checkpoint, so nothing is lost."""
    spec = resolve_run(cfg)
    main = spec.ddp.is_main
    ckpt = checkpoint_to_resume(spec.checkpoint_path, spec.device) if spec.resume else None
    seed_everything(spec.seed)

    model = spec.model.build()
    train_loader, val_loader = spec.data.loaders(spec.seed, spec.ddp)
    stock = copy.deepcopy(model)
    # A resumed budget run keeps the map it started with (fitting again may choose another).
    budget = ckpt.get("budget") if ckpt is not None and spec.memory_budget else None
    if budget is not None:
        spec = with_budget_plan(spec, CompressionPlan.from_dict(budget["plan"]))
    elif spec.memory_budget:  # the map comes from the budget, measured at the run's batch
        spec, fitted = choose_for_budget(model, first_batch(val_loader, spec.data.batch_size), spec)
        budget = {"plan": spec.plan.to_dict(), "record": fitted.record()}
    compress_model(model, spec.plan, spec.plan_given, spec.model.name)
    model.to(spec.device)
    model.to(memory_format=spec.memory_format)
    memory_batch = first_batch(val_loader, spec.data.memory_batch)
    memory = memory_record(stock, model, memory_batch, spec)
    if budget is not None:
        memory.update(budget["record"])
    del stock
    if main:  # reports of a run in progress read it here, never from the pickled checkpoint
        atomic_write_text(json.dumps(memory, indent=2), spec.out_dir / "memory.json")
    coverage = None
    if spec.coverage and main:
        coverage = write_coverage(model, memory_batch[0].to(spec.device), spec.out_dir, spec.label)
    state = training_state(model, spec, steps_per_epoch=len(train_loader))
    probe = spec.data.probe(spec.adaptive.probe_batch, spec.seed) if spec.adaptive.every else None

    at = Position()
    if ckpt is not None:
        at = restore_checkpoint(ckpt, state, spec.config)
        ckpt = None  # its tensors are copies on the device: free them
    if main:
        # Rewrite from the checkpoint: drops lines of epochs that finished after the last checkpoint.
        atomic_write_text("".join(json.dumps(h) + "\n" for h in at.history), spec.out_dir / "metrics.jsonl")
        OmegaConf.save(OmegaConf.create(spec.config), spec.out_dir / "config.yaml")

    logger = build_logger(spec.log, spec.config, spec.out_dir, spec.resume) if main else Logger()
    checkpoints = Checkpoints(spec.checkpoint_path, memory, spec.config, budget)
    try:
        logger.summary({k: v for k, v in memory.items() if k != "saved_bytes_per_layer"})
        if coverage is not None:
            logger.table("coverage", coverage.as_records())
        with StopSignals() as stop:
            while at.epoch < spec.epochs:
                if at.step == 0:  # a resumed epoch keeps the RNG state and the plan it was saved with
                    torch.manual_seed(epoch_seed(spec.seed, at.epoch))
                    if spec.adaptive.due(at.epoch):
                        at.adaptive_plan = adapt_compression(
                            state.net, probe, spec, at.epoch, memory_batch[0], logger)
                train_loader.set_epoch(at.epoch, start=at.step)
                record = train_epoch(state, spec, train_loader, at, stop, logger, checkpoints)
                record.update(evaluate(state.net, val_loader, spec.task, spec.device, spec.precision))
                end_epoch(record, at, spec, logger, memory)
                if record.get("diverged"):  # no checkpoint: resuming would diverge again
                    break
                if main and (at.epoch % spec.checkpoint_every == 0 or at.epoch == spec.epochs):
                    checkpoints.save(state, at)
                if on_epoch_end is not None and main:
                    on_epoch_end(at.epoch, record)
                signum = stop.requested(spec.device)
                if signum:
                    if main:
                        checkpoints.save(state, at)
                    raise Interrupted(signum, at, len(train_loader), spec.out_dir)
        metrics = summarize(spec, at.history, memory)
        if main:
            atomic_write_text(json.dumps(metrics, indent=2), spec.out_dir / "metrics.json")
        logger.summary({k: v for k, v in metrics.items() if not isinstance(v, (list, dict))})
        logger.results(metrics)  # W&B: trade-off table row + memory-vs-accuracy plot
    except BaseException:
        logger.finish(exit_code=1)
        raise
    logger.finish(exit_code=0)
    teardown(spec.ddp)
    return metrics


def memory_record(stock: nn.Module, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                  spec: RunSpec) -> dict[str, Any]:
    """Saved bytes and whole-step peak (with the task's loss) of stock and compressed on one batch,
    labelled with the compression plan; a plan that keeps more than stock says so."""
    plan = spec.plan
    memory = measure(stock, None if plan.is_stock else model, batch, spec.device, spec.precision,
                     lambda net: spec.optim.optimizer_for(net.parameters()), spec.task.criterion)
    memory.update(plan.record())
    if spec.ddp.is_main and memory["ratio"] > 1:
        log.warning("lessmem: compression %r (%s) keeps %.3fx the stock bytes (%.2f vs %.2f MiB): it "
                    "costs memory instead of saving it%s", plan.label, plan.digest, memory["ratio"],
                    memory["saved_bytes"] / 2**20, memory["stock_saved_bytes"] / 2**20,
                    "" if plan.exact_companions else "; exact_companions is off, so ReLU and "
                    "max-pool keep full tensors beside the pooled copies")
    return memory


def training_state(model: nn.Module, spec: RunSpec, steps_per_epoch: int) -> TrainState:
    """The wrapped model, its optimizer, per-step schedule and loss scaler."""
    net, wrapped = wrap_for_training(model, spec.ddp, spec.device, sync_bn=spec.sync_bn,
                                     compile_mode=spec.compile_mode)
    optimizer = spec.optim.optimizer_for(net.parameters())
    scheduler = spec.optim.schedule(optimizer, spec.epochs, steps_per_epoch)
    scaler = torch.amp.GradScaler(spec.device.type, enabled=spec.precision == "fp16")
    return TrainState(net, wrapped, optimizer, scheduler, scaler)


def train_epoch(state: TrainState, spec: RunSpec, loader: Any, at: Position, stop: StopSignals,
                logger: Logger, checkpoints: Checkpoints) -> dict[str, Any]:
    """Epoch ``at.epoch`` from step ``at.step`` on: its training record. ``at`` moves step by step
    (with the epoch's running sums), so a checkpoint within the epoch resumes exactly there."""
    state.model.train()
    task, main, steps = spec.task, spec.ddp.is_main, len(loader)
    if not at.partial:
        at.partial = {"lr": state.optimizer.param_groups[0]["lr"], "sums": dict.fromkeys(task.train_keys, 0.0),
                      "cosine": {}, "seconds": 0.0}
    sums = at.partial["sums"]
    start = time.perf_counter() - at.partial["seconds"]
    bar = with_progress(loader, f"epoch {at.epoch + 1}/{spec.epochs}", "step", total=steps, initial=at.step,
                        every=spec.log.every_steps, show=main)
    for x, y in bar:
        global_step = at.epoch * steps + at.step
        loss, logits, x, y = train_step(state, spec, x, y)
        for key, value in task.train_sums(logits, y, loss).items():
            sums[key] += value
        part = nonfinite_part(loss, state.net.parameters(), not state.scaler.is_enabled(), spec.device)
        if part is not None:  # counted in the epoch's sums (its loss), not applied to the weights
            at.partial["diverged"] = divergence_record(part, loss, at.epoch, at.step, global_step)
            if main:
                log.warning("lessmem: %s", divergence_message(at.partial["diverged"]))
            break
        if spec.grad_cosine_every and global_step % spec.grad_cosine_every == 0:
            record_grad_cosine(state, spec, (x, y), at, global_step, logger)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.scheduler.step()
        fault_point("train_step")
        at.step += 1
        at.partial["seconds"] = time.perf_counter() - start
        lr = state.optimizer.param_groups[0]["lr"]
        bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.3g}")
        signum = stop.requested(spec.device)
        every = spec.checkpoint_every_steps
        if main and (signum or (every and at.step % every == 0 and at.step < steps)):
            checkpoints.save(state, at)
        if signum:
            bar.close()
            raise Interrupted(signum, at, steps, spec.out_dir)
    bar.close()
    totals = dict(zip(sums, all_reduce_sum(list(sums.values()), spec.device), strict=True))  # global batch
    record: dict[str, Any] = {"epoch": at.epoch + 1, "lr": at.partial["lr"],
                              **task.train_record(totals, time.perf_counter() - start)}
    if diverged := at.partial.get("diverged"):
        record["diverged"] = diverged
    if cosine := at.partial["cosine"]:
        per_layer = {n: sum(v) / len(v) for n, v in cosine.items()}
        record["grad_cosine_mean"] = sum(per_layer.values()) / len(per_layer)
        record["grad_cosine"] = per_layer
    return record


def train_step(state: TrainState, spec: RunSpec, x: torch.Tensor,
               y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Forward and backward of one batch (the optimizer steps after): loss, logits, and the batch
    on the device."""
    x, y = x.to(spec.device, non_blocking=True), y.to(spec.device, non_blocking=True)
    if spec.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with autocast(spec.device, spec.precision):
        logits = state.model(x)
        loss = spec.task.criterion(logits.float(), y)
    state.optimizer.zero_grad(set_to_none=True)
    state.scaler.scale(loss).backward()
    return loss, logits, x, y


def record_grad_cosine(state: TrainState, spec: RunSpec, batch: tuple[torch.Tensor, torch.Tensor],
                       at: Position, global_step: int, logger: Logger) -> None:
    """Cosine(exact, compressed weight grad) per layer on the batch just back-propagated: kept in
    the epoch's running sums, one line of grad_cosine.jsonl, logged per step."""
    x, y = batch
    cos = grad_cosine(unwrap(state.model), x, y, spec.task.criterion, spec.device, spec.precision)
    for name, c in cos.items():
        at.partial["cosine"].setdefault(name, []).append(c)
    if cos and spec.ddp.is_main:
        with (spec.out_dir / "grad_cosine.jsonl").open("a") as f:
            f.write(json.dumps({"step": global_step, "epoch": at.epoch + 1, "cosine": cos}) + "\n")
        logger.log({"step": global_step, **{f"grad_cosine/{n}": c for n, c in cos.items()}})


def end_epoch(record: dict[str, Any], at: Position, spec: RunSpec, logger: Logger, memory: dict[str, Any]) -> None:
    """Count the finished epoch in ``at`` and report it: metrics.jsonl, the tracker, one progress line."""
    at.history.append(record)
    at.epoch, at.step, at.partial = at.epoch + 1, 0, {}
    if spec.ddp.is_main:
        with (spec.out_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.info(epoch_line(record, spec.epochs, memory["ratio"]))
    logger.log(_wandb_names(record))


def summarize(spec: RunSpec, history: list[dict[str, Any]], memory: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": spec.model.name, "dataset": spec.data.name, "task": spec.task.name,
        "seed": spec.seed,
        "epochs": len(history),
        **spec.task.summary(history),
        **memory,
        "train_time_s": sum(h["epoch_time_s"] for h in history),
        "diverged": next((h["diverged"] for h in history if h.get("diverged")), None),
        "history": history,
    }


def _wandb_names(record: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"epoch": record["epoch"], "lr": record["lr"]}
    for k, v in record.items():
        if k.startswith(("train_", "val_")):
            split, _, metric = k.partition("_")
            out[f"{split}/{metric}"] = v
        elif k in ("epoch_time_s", "throughput_img_s", "throughput_tok_s"):
            out[f"time/{k}"] = v
        elif k == "grad_cosine_mean":
            out["train/grad_cosine_mean"] = v
    return out
