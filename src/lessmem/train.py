"""Training entry: ``run(cfg) -> metrics`` (used by the CLI, sweeps and tests).

Writes to ``cfg.out_dir``: ``config.yaml`` (resolved), ``metrics.jsonl`` (one line per epoch),
``checkpoint.pt`` (atomic), ``metrics.json`` (final), and ``grad_cosine.jsonl`` when enabled.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch import distributed as dist
from tqdm.auto import tqdm

import lessmem
from lessmem.data import build_loaders
from lessmem.loggers import Logger as NullLogger
from lessmem.loggers import build_logger
from lessmem.models import build_model_from_cfg
from lessmem.paths import resolve_path

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
TIME_KEYS = ("epoch_time_s", "throughput_img_s", "train_time_s")  # differ between identical runs


# --------------------------------------------------------------------------- config helpers


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name} but CUDA is not available; use device=cpu or auto")
    return torch.device(name)


def validate(cfg: DictConfig, device: torch.device) -> None:
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {cfg.precision!r}")
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ValueError("precision=fp16 needs CUDA (GradScaler); on CPU use bf16 or fp32")
    for key in ("epochs", "batch_size", "eval_batch_size", "memory_batch", "checkpoint_every"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    if cfg.get("sync_bn") and _world_size() > 1:
        if device.type != "cuda":
            raise ValueError(
                "sync_bn=true needs CUDA: torch's SyncBatchNorm has no CPU (gloo) implementation. "
                "On CPU use sync_bn=false (BatchNorm statistics per rank) or a model without BatchNorm"
            )
        if cfg.compression.get("norm_storage", "native") != "native":
            raise ValueError("sync_bn=true needs compression.norm_storage=native (SyncBatchNorm "
                             "replaces the reduced-storage BatchNorm layers)")


# --------------------------------------------------------------------------- distributed


@dataclass
class DistInfo:
    """This process's place in a ``torchrun`` job; rank 0 of 1 without one."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # init_process_group was called here (destroyed at the end of run)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def setup_distributed(cfg: DictConfig, device: torch.device) -> tuple[DistInfo, torch.device]:
    """Join the process group ``torchrun`` describes (WORLD_SIZE / RANK / LOCAL_RANK in the
    environment). ``distributed.backend``: auto = nccl on CUDA, gloo on CPU. Each rank uses GPU
    ``LOCAL_RANK`` when the device is CUDA. One process (no torchrun): nothing to do."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not (dist.is_available() and dist.is_initialized()):
        return DistInfo(), device
    dcfg = cfg.get("distributed") or {}
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        backend = str(dcfg.get("backend", "auto"))
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=int(dcfg.get("timeout_s", 1800))))
        owns = True
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, owns), device


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum per-rank numbers over all ranks (unchanged in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(t)
    return t.tolist()


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def compression_map(ccfg: DictConfig) -> dict[str, Any]:
    """The pattern -> kernel map: ``compression.map_file`` (YAML with a top-level ``map:`` or a
    plain map) when set, else ``compression.map``."""
    if ccfg.get("map_file"):
        path = resolve_path(ccfg.map_file)
        if not path.is_file():
            raise FileNotFoundError(f"compression.map_file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if isinstance(data, dict) and isinstance(data.get("map"), dict):
            data = data["map"]
        if not isinstance(data, dict):
            raise ValueError(f"compression.map_file {path}: expected a mapping of pattern -> kernel")
        return data
    raw = ccfg.get("map") or {}
    return OmegaConf.to_container(raw) if isinstance(raw, DictConfig) else dict(raw)


def build_optimizer(ocfg: DictConfig, params: Any) -> torch.optim.Optimizer:
    if ocfg.name == "sgd":
        return torch.optim.SGD(params, lr=ocfg.lr, momentum=ocfg.get("momentum", 0.0),
                               weight_decay=ocfg.get("weight_decay", 0.0),
                               nesterov=bool(ocfg.get("nesterov", False)))
    if ocfg.name == "adamw":
        return torch.optim.AdamW(params, lr=ocfg.lr, betas=tuple(ocfg.get("betas", (0.9, 0.999))),
                                 weight_decay=ocfg.get("weight_decay", 0.01))
    raise ValueError(f"unknown optimizer {ocfg.name!r}; available: sgd, adamw")


def build_scheduler(scfg: DictConfig, optimizer: torch.optim.Optimizer, epochs: int,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule: linear warmup, then cosine / step / constant. The cosine horizon is
    ``epochs``, so resume with the same ``epochs`` to reproduce an uninterrupted run."""
    total, warmup = epochs * steps_per_epoch, int(scfg.get("warmup_epochs", 0) * steps_per_epoch)
    name = scfg.name
    if name not in ("cosine", "step", "none"):
        raise ValueError(f"unknown scheduler {name!r}; available: cosine, step, none")
    floor = float(scfg.get("min_lr_ratio", 0.0))
    milestones = [int(m) * steps_per_epoch for m in scfg.get("milestones", [])]
    gamma = float(scfg.get("gamma", 0.1))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if name == "cosine":
            t = (step - warmup) / max(1, total - warmup)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
        if name == "step":
            return gamma ** sum(step >= m for m in milestones)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- measurements


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def first_images(loader: Any, n: int) -> Tensor:
    return first_batch(loader, n)[0]


def measure(stock: nn.Module, model: nn.Module, x: Tensor, device: torch.device, precision: str) -> dict[str, Any]:
    """Saved-for-backward bytes of the stock and the compressed model on one batch. Runs on
    copies in train mode so BatchNorm statistics and RNG of the real model are untouched."""
    out: dict[str, Any] = {"memory_batch": len(x)}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for prefix, net in (("stock_", stock), ("", model)):
            net = copy.deepcopy(net).to(device).train()
            with autocast(device, precision):
                report = lessmem.measure_memory(net, x.to(device))
            out[f"{prefix}saved_bytes"] = report.total_bytes
            out[f"{prefix}cuda_peak_bytes"] = report.cuda_peak_bytes
            if not prefix:
                out["saved_bytes_per_layer"] = report.per_layer
            del net
    out["ratio"] = out["saved_bytes"] / out["stock_saved_bytes"] if out["stock_saved_bytes"] else float("nan")
    return out


def first_batch(loader: Any, n: int) -> tuple[Tensor, Tensor]:
    """The first ``n`` (images, labels) of a loader: a fixed probe batch."""
    xs, ys, have = [], [], 0
    for x, y in loader:
        xs.append(x)
        ys.append(y)
        have += len(y)
        if have >= n:
            break
    return torch.cat(xs)[:n], torch.cat(ys)[:n]


def compress_from_config(net: nn.Module, mapping: dict[str, Any], cfg: DictConfig) -> None:
    """Apply ``mapping`` with the config's norm storage and exact-companion settings."""
    lessmem.compress(net, mapping, norm_storage=cfg.compression.get("norm_storage", "native"),
                     exact_companions=bool(cfg.compression.get("exact_companions", True)))


def adapt_compression(net: nn.Module, probe: tuple[Tensor, Tensor], acfg: Any, cfg: DictConfig,
                      epoch: int, x_memory: Tensor, out_dir: Path, logger: Any,
                      is_main: bool) -> dict[str, int]:
    """Adaptive schedule: re-measure every conv's weight-gradient fidelity on the fixed probe
    batch and re-assign kernels greedily within the memory budget (most bytes saved per
    fidelity lost). Deterministic, so every DDP rank arrives at the same map."""
    from lessmem.sensitivity import append_history, sensitivity

    device = next(net.parameters()).device
    was_training = net.training
    net.train()
    result = sensitivity(net, [(probe[0].to(device), probe[1].to(device))],
                         kernels=[int(k) for k in acfg.get("kernels", (1, 2, 4, 8))])
    budget = acfg.get("budget")
    mapping = result.make_map(None if budget is None else float(budget), acfg.get("min_cosine"))
    compress_from_config(net, mapping, cfg)
    net.train(was_training)
    change = {
        "epoch": epoch, "conv_input_bytes": result.saved_bytes(mapping),
        "conv_input_bytes_uncompressed": result.baseline_bytes(),
        "mean_grad_cosine": result.mean_cosine(mapping),
        "saved_bytes": lessmem.measure_memory(net, x_memory.to(device)).total_bytes,
        "map": {n: k for n, k in mapping.items() if k != 1},
    }
    if is_main:
        append_history(result, out_dir / "sensitivity.csv", step=epoch, epoch=epoch)
        with (out_dir / "adaptive.jsonl").open("a") as f:
            f.write(json.dumps(change) + "\n")
        log.info("adaptive map at epoch %d: %d conv-input bytes (%.3f of exact), mean cosine %.3f",
                 epoch, change["conv_input_bytes"],
                 change["conv_input_bytes"] / max(1, change["conv_input_bytes_uncompressed"]),
                 change["mean_grad_cosine"])
    logger.log({f"adaptive/{k}": v for k, v in change.items() if k != "map"} | {"epoch": epoch})
    return mapping


def write_coverage(model: nn.Module, x: Tensor, out_dir: Path, title: str) -> lessmem.CoverageReport:
    """Which saved tensors are compressed and which stay full (coverage.csv/json/png)."""
    from lessmem.coverage_cli import save_report

    report = lessmem.coverage(model, x)
    save_report(report, out_dir, title)
    return report


def grad_cosine(model: nn.Module, x: Tensor, y: Tensor, criterion: nn.Module, device: torch.device,
                precision: str) -> dict[str, float]:
    """Cosine(exact weight grad, compressed weight grad) per compressed layer, on the batch whose
    compressed grads are in ``model`` now. The exact grads come from an uncompressed copy
    (forward is exact, so both see identical activations); scale-invariant, so GradScaler is fine."""
    layers = lessmem.compressed_layers(model)
    if not layers:
        return {}
    grads = {n: model.get_submodule(n).weight.grad for n in layers}
    exact = copy.deepcopy(model)
    lessmem.uncompress(exact)
    exact.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast(device, precision):
            loss = criterion(exact(x), y)
        loss.backward()
    out = {}
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for name, g in grads.items():
        ge = exact.get_submodule(name).weight.grad
        if ge is not None and world > 1:  # DDP averaged the compressed grads over the ranks
            dist.all_reduce(ge)
            ge /= world
        if g is not None and ge is not None:
            out[name] = F.cosine_similarity(g.flatten().float(), ge.flatten().float(), dim=0).item()
    return out


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, criterion: nn.Module, device: torch.device,
             precision: str) -> dict[str, float]:
    model.eval()
    loss_sum, top1, top5, n = 0.0, 0, 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, precision):
            logits = model(x)
        loss_sum += criterion(logits.float(), y).item() * len(y)
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        top1 += (top[:, 0] == y).sum().item()
        top5 += (top == y[:, None]).any(dim=1).sum().item()
        n += len(y)
    loss_sum, top1, top5, n = _all_reduce_sum([loss_sum, top1, top5, n], device)  # ranks' shards
    return {"val_loss": loss_sum / n, "val_top1": top1 / n, "val_top5": top5 / n}


# --------------------------------------------------------------------------- checkpoints


def atomic_torch_save(obj: Any, path: Path) -> None:
    """Write to a temp file then rename: a crash mid-write leaves the previous file intact."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


# --------------------------------------------------------------------------- run


def default_out_dir() -> Path:
    return Path("outputs") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


EpochCallback = Callable[[int, dict[str, Any]], None]


def run(cfg: DictConfig, on_epoch_end: EpochCallback | None = None) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.dataset`` with ``cfg.compression``; returns the final metrics.

    ``on_epoch_end(epoch, record)`` is called on the main process after each epoch's evaluation
    and checkpoint (epoch counts from 1; ``record`` has ``val_top1`` etc.). An exception it raises
    (e.g. ``optuna.TrialPruned``) ends the run after the checkpoint, so nothing is lost."""
    cfg = copy.deepcopy(cfg)
    device = resolve_device(str(cfg.device))
    # Under torchrun: batch_size is per rank (global batch = world_size x batch_size), each rank
    # trains on its shard of every global batch, rank 0 writes files and talks to W&B.
    ddp, device = setup_distributed(cfg, device)
    out_dir = Path(cfg.get("out_dir") or default_out_dir()).resolve()
    if ddp.world_size > 1:  # rank 0's (Hydra's run dir may differ by a second between ranks)
        box = [str(out_dir)]
        dist.broadcast_object_list(box, src=0)
        out_dir = Path(box[0])
    with _open_struct(cfg):
        cfg.out_dir = str(out_dir)
    validate(cfg, device)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "checkpoint.pt"
    if cfg.resume and not ckpt_path.exists():
        raise FileNotFoundError(
            f"resume=true but there is no checkpoint at {ckpt_path}; point out_dir (or hydra.run.dir) "
            "at the directory of the run to continue"
        )
    seed = int(cfg.seed)
    seed_everything(seed)

    model = build_model_from_cfg(cfg)
    train_loader, val_loader = build_loaders(
        cfg.dataset, int(cfg.batch_size), int(cfg.eval_batch_size), seed, cfg.get("max_steps_per_epoch"),
        rank=ddp.rank, world_size=ddp.world_size,
    )
    stock = copy.deepcopy(model)
    mapping = compression_map(cfg.compression)
    try:
        compress_from_config(model, mapping, cfg)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"compression {cfg.compression.get('name', '?')!r} does not fit model {cfg.model.name!r}: {e}"
        ) from e
    model.to(device)
    memory_format = torch.channels_last if cfg.get("channels_last") else torch.contiguous_format
    model.to(memory_format=memory_format)
    x_memory = first_images(val_loader, int(cfg.memory_batch))
    memory = measure(stock, model, x_memory, device, cfg.precision)
    del stock
    coverage = None
    if cfg.get("coverage") and ddp.is_main:
        coverage = write_coverage(model, x_memory.to(device), out_dir, f"{cfg.model.name} / {cfg.compression.get('name', 'custom')}")
    net = model  # the module itself: optimizer, checkpoints, evaluation, grad cosine
    if ddp.world_size > 1:
        if cfg.get("sync_bn"):
            net = model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # Compressed layers are autograd Functions with ordinary parameters: DDP's hooks
        # all-reduce (average) their weight gradients like any other layer's.
        model = nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.get("compile"):
        # Compressed layers are custom ops under torch.compile: traced, not graph breaks.
        model = torch.compile(model, mode=cfg.get("compile_mode") or None)

    criterion = nn.CrossEntropyLoss(label_smoothing=float(cfg.get("label_smoothing", 0.0)))
    optimizer = build_optimizer(cfg.optimizer, net.parameters())
    steps_per_epoch = len(train_loader)
    scheduler = build_scheduler(cfg.scheduler, optimizer, int(cfg.epochs), steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")

    adaptive = cfg.get("adaptive") or {}
    adapt_every = int(adaptive.get("every") or 0)
    if adapt_every and cfg.get("compile"):
        raise ValueError("adaptive.every > 0 re-assigns kernels during training; it cannot be combined with compile=true")
    probe = first_batch(val_loader, int(adaptive.get("probe_batch", 32))) if adapt_every else None

    start_epoch, history, adaptive_map = 0, [], None
    if cfg.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        _check_compatible(ckpt.get("config", {}), cfg)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        # Recompute the lr from the (possibly longer) schedule: resuming with more epochs than
        # the checkpointed run stretches the cosine instead of continuing from its end value.
        for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
            group["lr"] = base * fn(scheduler.last_epoch)
        scaler.load_state_dict(ckpt["scaler"])
        set_rng_state(ckpt["rng"])
        start_epoch, history = int(ckpt["epoch"]), list(ckpt["history"])
        if ckpt.get("adaptive_map") is not None:  # the kernels in force when it was saved
            adaptive_map = ckpt["adaptive_map"]
            compress_from_config(net, adaptive_map, cfg)
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
            # Reseeding per epoch makes an epoch's randomness independent of earlier epochs, so a
            # resumed run matches an uninterrupted one without replaying RNG streams.
            torch.manual_seed(seed * 100_003 + epoch)
            train_loader.set_epoch(epoch)
            if adapt_every and epoch % adapt_every == 0:
                adaptive_map = adapt_compression(net, probe, adaptive, cfg, epoch, x_memory, out_dir,
                                                 logger, ddp.is_main)
            record = train_epoch(model, train_loader, criterion, optimizer, scheduler, scaler, cfg,
                                 device, epoch, steps_per_epoch, logger, out_dir)
            record.update(evaluate(net, val_loader, criterion, device, cfg.precision))
            history.append(record)
            if ddp.is_main:
                with (out_dir / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(record) + "\n")
            logger.log(_wandb_names(record))
            done = epoch + 1
            if ddp.is_main and (done % int(cfg.checkpoint_every) == 0 or done == int(cfg.epochs)):
                atomic_torch_save({
                    "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": done, "rng": rng_state(), "history": history, "memory": memory,
                    "config": OmegaConf.to_container(cfg, resolve=True),
                    "adaptive_map": adaptive_map if adapt_every else None,
                }, ckpt_path)
            if on_epoch_end is not None and ddp.is_main:
                on_epoch_end(done, record)
        metrics = summarize(cfg, history, memory)
        if ddp.is_main:
            atomic_write_text(json.dumps(metrics, indent=2), out_dir / "metrics.json")
        logger.summary({k: v for k, v in metrics.items() if not isinstance(v, (list, dict))})
        logger.results(metrics)  # W&B: trade-off table row + memory-vs-accuracy plot
    except BaseException:
        logger.finish(exit_code=1)
        raise
    logger.finish(exit_code=0)
    if ddp.owns_group:
        dist.barrier()
        dist.destroy_process_group()
    return metrics


def train_epoch(model: nn.Module, loader: Any, criterion: nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: Any, scaler: torch.amp.GradScaler, cfg: DictConfig, device: torch.device,
                epoch: int, steps_per_epoch: int, logger: Any, out_dir: Path) -> dict[str, Any]:
    model.train()
    lr = optimizer.param_groups[0]["lr"]
    loss_sum, correct, seen = 0.0, 0, 0
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
            loss = criterion(logits.float(), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if cos_every and global_step % cos_every == 0:
            cos = grad_cosine(_unwrap(model), x, y, criterion, device, cfg.precision)
            for name, c in cos.items():
                cos_sums[name].append(c)
            if cos and main:
                with (out_dir / "grad_cosine.jsonl").open("a") as f:
                    f.write(json.dumps({"step": global_step, "epoch": epoch + 1, "cosine": cos}) + "\n")
                logger.log({"step": global_step, **{f"grad_cosine/{n}": c for n, c in cos.items()}})
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        loss_sum += loss.item() * len(y)
        correct += (logits.argmax(1) == y).sum().item()
        seen += len(y)
        bar.set_postfix(loss=f"{loss_sum / seen:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.3g}")
    bar.close()
    loss_sum, correct, seen = _all_reduce_sum([loss_sum, correct, seen], device)  # global batch
    elapsed = time.perf_counter() - start
    record: dict[str, Any] = {
        "epoch": epoch + 1, "lr": lr, "train_loss": loss_sum / seen, "train_top1": correct / seen,
        "epoch_time_s": elapsed, "throughput_img_s": seen / elapsed,
    }
    if cos_sums:
        per_layer = {n: sum(v) / len(v) for n, v in cos_sums.items()}
        record["grad_cosine_mean"] = sum(per_layer.values()) / len(per_layer)
        record["grad_cosine"] = per_layer
    return record


def summarize(cfg: DictConfig, history: list[dict[str, Any]], memory: dict[str, Any]) -> dict[str, Any]:
    best = max(history, key=lambda h: h["val_top1"])
    last = history[-1]
    return {
        "model": cfg.model.name, "dataset": cfg.dataset.name,
        "compression": cfg.compression.get("name"), "seed": int(cfg.seed),
        "epochs": len(history),
        "final_top1": last["val_top1"], "final_top5": last["val_top5"], "final_val_loss": last["val_loss"],
        "final_train_loss": last["train_loss"],
        "best_top1": best["val_top1"], "best_top5": best["val_top5"], "best_epoch": best["epoch"],
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
        elif k in ("epoch_time_s", "throughput_img_s"):
            out[f"time/{k}"] = v
        elif k == "grad_cosine_mean":
            out["train/grad_cosine_mean"] = v
    return out


def _check_compatible(saved: dict[str, Any], cfg: DictConfig) -> None:
    now = OmegaConf.to_container(cfg, resolve=True)
    for key in ("model", "compression", "optimizer", "scheduler", "batch_size", "seed"):
        if key in saved and saved[key] != now.get(key):
            raise ValueError(f"resume: {key} differs from the checkpoint's ({saved[key]} vs {now.get(key)})")


@contextlib.contextmanager
def _open_struct(cfg: DictConfig):
    # Configs from compose() are in struct mode; out_dir may be absent in hand-built ones.
    struct = OmegaConf.is_struct(cfg)
    OmegaConf.set_struct(cfg, False)
    try:
        yield
    finally:
        OmegaConf.set_struct(cfg, struct)


if __name__ == "__main__":
    from lessmem.cli import train_main

    train_main()
