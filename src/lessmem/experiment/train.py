"""Training entry: ``run(cfg) -> metrics`` (used by the CLI, sweeps, search and tests).

Writes to ``cfg.out_dir``: ``config.yaml`` (resolved), ``memory.json`` (saved-bytes measurement,
before the first epoch), ``metrics.jsonl`` (one line per epoch), ``checkpoint.pt`` (atomic),
``metrics.json`` (final, memory fields included), and ``grad_cosine.jsonl`` when enabled.
``run`` reads top-down: place the run (``runtime``, ``distributed``), build the model
(``model``), data (``data``), optimizer and schedule (``optim``), measure (``probes``), restore
(``checkpoint``), then train epoch by epoch (``adaptive`` re-assigns kernels on the way).
``lessmem.cli.train`` is the console entry.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm.auto import tqdm

from lessmem.experiment.adaptive import adapt_compression
from lessmem.experiment.budget import choose_for_budget
from lessmem.experiment.checkpoint import checkpoint_to_resume, restore_checkpoint, save_checkpoint
from lessmem.experiment.compose import open_struct
from lessmem.experiment.compression import CompressionChoice
from lessmem.experiment.coverage_files import write_coverage
from lessmem.experiment.data import build_loaders
from lessmem.experiment.distributed import (
    DistInfo,
    all_reduce_sum,
    broadcast_object,
    is_main_process,
    setup_distributed,
    teardown,
    unwrap,
)
from lessmem.experiment.faults import fault_point
from lessmem.experiment.files import atomic_write_text
from lessmem.experiment.loggers import Logger as NullLogger
from lessmem.experiment.loggers import build_logger
from lessmem.experiment.model import build_model_from_cfg, compress_as_configured, wrap_for_training
from lessmem.experiment.optim import build_optimizer, build_scheduler
from lessmem.experiment.probes import evaluate, first_batch, grad_cosine, measure
from lessmem.experiment.runtime import PRECISIONS, autocast, resolve_device, validate
from lessmem.experiment.seeds import epoch_seed, seed_everything
from lessmem.experiment.task import Task, task_of

log = logging.getLogger(__name__)

TIME_KEYS = ("epoch_time_s", "throughput_img_s", "throughput_tok_s", "train_time_s")  # differ between identical runs


def default_out_dir() -> Path:
    return Path("outputs") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


EpochCallback = Callable[[int, dict[str, Any]], None]


def place_run(cfg: DictConfig) -> tuple[DistInfo, torch.device, Path]:
    """The run's process group, device and output directory (``cfg.out_dir`` set to it), with the
    settings checked against the device before anything is built."""
    device = resolve_device(str(cfg.device))
    # Under torchrun: batch_size is per rank (global batch = world_size x batch_size), each rank
    # trains on its shard of every global batch, rank 0 writes files and talks to W&B.
    ddp, device = setup_distributed(cfg, device)
    out_dir = Path(cfg.get("out_dir") or default_out_dir()).resolve()
    # rank 0's (Hydra's run dir may differ by a second between ranks)
    out_dir = Path(broadcast_object(str(out_dir)))
    with open_struct(cfg):
        cfg.out_dir = str(out_dir)
    validate(cfg, device)
    out_dir.mkdir(parents=True, exist_ok=True)
    return ddp, device, out_dir


def run(cfg: DictConfig, on_epoch_end: EpochCallback | None = None) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.dataset`` with ``cfg.compression``; returns the final metrics.

    ``on_epoch_end(epoch, record)`` is called on the main process after each epoch's evaluation
    and checkpoint (epoch counts from 1; ``record`` has ``val_top1`` etc., ``val_ppl`` for a language
    model: ``lessmem.experiment.task``). An exception it raises
    (e.g. ``optuna.TrialPruned``) ends the run after the checkpoint, so nothing is lost."""
    cfg = copy.deepcopy(cfg)
    ddp, device, out_dir = place_run(cfg)
    ckpt_path = out_dir / "checkpoint.pt"
    ckpt = checkpoint_to_resume(cfg, ckpt_path, device)
    seed = int(cfg.seed)
    seed_everything(seed)
    task = task_of(cfg)

    model = build_model_from_cfg(cfg)
    train_loader, val_loader = build_loaders(
        cfg.dataset, int(cfg.batch_size), int(cfg.eval_batch_size), seed, cfg.get("max_steps_per_epoch"),
        rank=ddp.rank, world_size=ddp.world_size,
    )
    stock = copy.deepcopy(model)
    memory_format = torch.channels_last if cfg.get("channels_last") else torch.contiguous_format
    budget = None
    if cfg.get("memory_budget"):  # the map comes from the budget, measured at the run's batch
        memory_batch = first_batch(val_loader, int(cfg.batch_size))
        choice, budget = choose_for_budget(
            copy.deepcopy(model).to(device, memory_format=memory_format), (memory_batch[0].to(device), memory_batch[1].to(device)),
            cfg.memory_budget, lambda params: build_optimizer(cfg.optimizer, params), task.criterion,
            PRECISIONS[cfg.precision], out_dir)
        choice.apply(model)
    else:
        choice = compress_as_configured(model, cfg)
        memory_batch = first_batch(val_loader, int(cfg.memory_batch))
    model.to(device)
    model.to(memory_format=memory_format)
    x_memory = memory_batch[0]
    memory = memory_record(stock, model, memory_batch, device, cfg, choice, task, warn=ddp.is_main)
    if budget is not None:
        memory.update(budget.record())
    del stock
    if ddp.is_main:  # reports of a run in progress read it here, never from the pickled checkpoint
        atomic_write_text(json.dumps(memory, indent=2), out_dir / "memory.json")
    coverage = None
    if cfg.get("coverage") and ddp.is_main:
        coverage = write_coverage(model, x_memory.to(device), out_dir, f"{cfg.model.name} / {choice.name}")
    net, model = wrap_for_training(model, cfg, ddp, device)

    optimizer = build_optimizer(cfg.optimizer, net.parameters())
    steps_per_epoch = len(train_loader)
    scheduler = build_scheduler(cfg.scheduler, optimizer, int(cfg.epochs), steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")

    adaptive = cfg.get("adaptive") or {}
    adapt_every = int(adaptive.get("every") or 0)
    probe = first_batch(val_loader, int(adaptive.get("probe_batch", 32))) if adapt_every else None

    start_epoch, history, adaptive_map = 0, [], None
    if ckpt is not None:
        start_epoch, history, adaptive_map = restore_checkpoint(ckpt, cfg, net, optimizer, scheduler, scaler)
        ckpt = None  # its tensors are copies on the device: free them
    if ddp.is_main:
        # Rewrite from the checkpoint: drops lines of epochs that finished after the last checkpoint.
        atomic_write_text("".join(json.dumps(h) + "\n" for h in history), out_dir / "metrics.jsonl")
        OmegaConf.save(cfg, out_dir / "config.yaml", resolve=True)

    logger = build_logger(cfg, out_dir) if ddp.is_main else NullLogger()
    try:
        logger.summary({k: v for k, v in memory.items() if k != "saved_bytes_per_layer"})
        if coverage is not None:
            logger.table("coverage", coverage.as_records())
        for epoch in range(start_epoch, int(cfg.epochs)):
            torch.manual_seed(epoch_seed(seed, epoch))
            train_loader.set_epoch(epoch)
            if adapt_every and epoch % adapt_every == 0:
                adaptive_map = adapt_compression(net, probe, adaptive, cfg, epoch, x_memory, out_dir,
                                                 logger, ddp.is_main, task.criterion)
            record = train_epoch(model, train_loader, task, optimizer, scheduler, scaler, cfg,
                                 device, epoch, steps_per_epoch, logger, out_dir)
            record.update(evaluate(net, val_loader, task, device, cfg.precision))
            history.append(record)
            if ddp.is_main:
                with (out_dir / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(record) + "\n")
            logger.log(_wandb_names(record))
            done = epoch + 1
            if ddp.is_main and (done % int(cfg.checkpoint_every) == 0 or done == int(cfg.epochs)):
                save_checkpoint(ckpt_path, net, optimizer, scheduler, scaler, epoch=done, history=history,
                                memory=memory, cfg=cfg, adaptive_map=adaptive_map if adapt_every else None)
            if on_epoch_end is not None and ddp.is_main:
                on_epoch_end(done, record)
        metrics = summarize(cfg, task, history, memory)
        if ddp.is_main:
            atomic_write_text(json.dumps(metrics, indent=2), out_dir / "metrics.json")
        logger.summary({k: v for k, v in metrics.items() if not isinstance(v, (list, dict))})
        logger.results(metrics)  # W&B: trade-off table row + memory-vs-accuracy plot
    except BaseException:
        logger.finish(exit_code=1)
        raise
    logger.finish(exit_code=0)
    teardown(ddp)
    return metrics


def memory_record(stock: nn.Module, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                  device: torch.device, cfg: DictConfig, choice: CompressionChoice, task: Task,
                  warn: bool) -> dict[str, Any]:
    """Saved bytes and whole-step peak (with the task's loss) of stock and compressed on one batch,
    labelled with the compression choice; a choice that keeps more than stock says so."""
    memory = measure(stock, model, batch, device, cfg.precision,
                     lambda net: build_optimizer(cfg.optimizer, net.parameters()), task.criterion)
    memory.update(choice.record())
    if warn and memory["ratio"] > 1:
        log.warning("lessmem: compression %r (%s) keeps %.3fx the stock bytes (%.2f vs %.2f MiB): it "
                    "costs memory instead of saving it%s", choice.name, choice.digest, memory["ratio"],
                    memory["saved_bytes"] / 2**20, memory["stock_saved_bytes"] / 2**20,
                    "" if choice.exact_companions else "; exact_companions is off, so ReLU and "
                    "max-pool keep full tensors beside the pooled copies")
    return memory


def train_epoch(model: nn.Module, loader: Any, task: Task, optimizer: torch.optim.Optimizer,
                scheduler: Any, scaler: torch.amp.GradScaler, cfg: DictConfig, device: torch.device,
                epoch: int, steps_per_epoch: int, logger: Any, out_dir: Path) -> dict[str, Any]:
    model.train()
    lr = optimizer.param_groups[0]["lr"]
    sums = dict.fromkeys(task.train_keys, 0.0)
    cos_every = int(cfg.get("grad_cosine_every") or 0)
    cos_sums: dict[str, list[float]] = defaultdict(list)
    start = time.perf_counter()
    main = is_main_process()
    bar = tqdm(loader, total=steps_per_epoch, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="step",
               dynamic_ncols=True, disable=None if main else True, leave=False)
    for step, (x, y) in enumerate(bar):
        global_step = epoch * steps_per_epoch + step
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cfg.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(device, cfg.precision):
            logits = model(x)
            loss = task.criterion(logits.float(), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if cos_every and global_step % cos_every == 0:
            cos = grad_cosine(unwrap(model), x, y, task.criterion, device, cfg.precision)
            for name, c in cos.items():
                cos_sums[name].append(c)
            if cos and main:
                with (out_dir / "grad_cosine.jsonl").open("a") as f:
                    f.write(json.dumps({"step": global_step, "epoch": epoch + 1, "cosine": cos}) + "\n")
                logger.log({"step": global_step, **{f"grad_cosine/{n}": c for n, c in cos.items()}})
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        fault_point("train_step")
        for key, value in task.train_sums(logits, y, loss).items():
            sums[key] += value
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.3g}")
    bar.close()
    sums = dict(zip(sums, all_reduce_sum(list(sums.values()), device), strict=True))  # global batch
    record: dict[str, Any] = {"epoch": epoch + 1, "lr": lr,
                              **task.train_record(sums, time.perf_counter() - start)}
    if cos_sums:
        per_layer = {n: sum(v) / len(v) for n, v in cos_sums.items()}
        record["grad_cosine_mean"] = sum(per_layer.values()) / len(per_layer)
        record["grad_cosine"] = per_layer
    return record


def summarize(cfg: DictConfig, task: Task, history: list[dict[str, Any]],
              memory: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": cfg.model.name, "dataset": cfg.dataset.name, "task": task.name,
        "seed": int(cfg.seed),
        "epochs": len(history),
        **task.summary(history),
        **memory,
        "train_time_s": sum(h["epoch_time_s"] for h in history),
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

