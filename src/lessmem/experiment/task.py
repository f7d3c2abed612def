"""What a run learns and how it is scored, chosen once per run from the configs (``task_of``):
image classification (cross-entropy on labels; top-1 / top-5) or causal language modelling
(next-token cross-entropy over every position; loss and perplexity, no top-k)."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn

TASKS = ("classification", "causal_lm")


class TokenCrossEntropy(nn.Module):
    """Mean cross-entropy of logits (batch, seq, vocab) against next tokens (batch, seq)."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(),
                               label_smoothing=self.label_smoothing)


class Task(Protocol):
    """The per-task pieces of a run: its loss, and the sums a training or evaluation pass adds
    up per batch (summed over ranks, then turned into the epoch's record)."""

    name: str
    samples: str  # what one row of a batch is, for titles
    # The sums' keys: every rank reduces all of them, even one whose shard had no batch.
    train_keys: tuple[str, ...]
    eval_keys: tuple[str, ...]
    criterion: nn.Module

    def train_sums(self, logits: Tensor, targets: Tensor, loss: Tensor) -> dict[str, float]: ...

    def train_record(self, sums: dict[str, float], elapsed: float) -> dict[str, float]: ...

    def eval_sums(self, logits: Tensor, targets: Tensor) -> dict[str, float]: ...

    def eval_record(self, sums: dict[str, float]) -> dict[str, float]: ...

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]: ...

    def headline(self, metrics: dict[str, Any]) -> str: ...

    def random_inputs(self, dataset: DictConfig, n: int) -> Tensor: ...


class Classification:
    name = "classification"
    samples = "images"
    train_keys = ("loss", "correct", "n")
    eval_keys = ("loss", "top1", "top5", "n")

    def __init__(self, label_smoothing: float) -> None:
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    def train_sums(self, logits: Tensor, targets: Tensor, loss: Tensor) -> dict[str, float]:
        return {"loss": loss.item() * len(targets), "correct": (logits.argmax(1) == targets).sum().item(),
                "n": len(targets)}

    def train_record(self, sums: dict[str, float], elapsed: float) -> dict[str, float]:
        return {"train_loss": sums["loss"] / sums["n"], "train_top1": sums["correct"] / sums["n"],
                "epoch_time_s": elapsed, "throughput_img_s": sums["n"] / elapsed}

    def eval_sums(self, logits: Tensor, targets: Tensor) -> dict[str, float]:
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        return {"loss": self.criterion(logits.float(), targets).item() * len(targets),
                "top1": (top[:, 0] == targets).sum().item(),
                "top5": (top == targets[:, None]).any(dim=1).sum().item(), "n": len(targets)}

    def eval_record(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["n"]
        return {"val_loss": sums["loss"] / n, "val_top1": sums["top1"] / n, "val_top5": sums["top5"] / n}

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        best, last = max(history, key=lambda h: h["val_top1"]), history[-1]
        return {"final_top1": last["val_top1"], "final_top5": last["val_top5"], "final_val_loss": last["val_loss"],
                "final_train_loss": last["train_loss"], "best_top1": best["val_top1"], "best_top5": best["val_top5"],
                "best_epoch": best["epoch"]}

    def headline(self, metrics: dict[str, Any]) -> str:
        return (f"top1 {metrics['final_top1']:.4f} (best {metrics['best_top1']:.4f} "
                f"@ epoch {metrics['best_epoch']})")

    def random_inputs(self, dataset: DictConfig, n: int) -> Tensor:
        """``n`` random images of the dataset's size (saved bytes depend on shapes only)."""
        size = int(dataset.image_size)
        return torch.randn(n, 3, size, size)


class CausalLM:
    """Next-token prediction: the dataset's targets are the inputs shifted by one."""

    name = "causal_lm"
    samples = "sequences"
    train_keys = ("loss", "tokens")
    eval_keys = ("loss", "tokens")

    def __init__(self, label_smoothing: float) -> None:
        self.criterion = TokenCrossEntropy(label_smoothing)

    def train_sums(self, logits: Tensor, targets: Tensor, loss: Tensor) -> dict[str, float]:
        return {"loss": loss.item() * targets.numel(), "tokens": targets.numel()}

    def train_record(self, sums: dict[str, float], elapsed: float) -> dict[str, float]:
        return {"train_loss": sums["loss"] / sums["tokens"], "epoch_time_s": elapsed,
                "throughput_tok_s": sums["tokens"] / elapsed}

    def eval_sums(self, logits: Tensor, targets: Tensor) -> dict[str, float]:
        return {"loss": self.criterion(logits, targets).item() * targets.numel(), "tokens": targets.numel()}

    def eval_record(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss"] / sums["tokens"]
        return {"val_loss": loss, "val_ppl": math.exp(loss)}

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        best, last = min(history, key=lambda h: h["val_loss"]), history[-1]
        return {"final_val_loss": last["val_loss"], "final_val_ppl": last["val_ppl"],
                "final_train_loss": last["train_loss"], "best_val_loss": best["val_loss"],
                "best_val_ppl": best["val_ppl"], "best_epoch": best["epoch"]}

    def headline(self, metrics: dict[str, Any]) -> str:
        return (f"val_ppl {metrics['final_val_ppl']:.3f} (best {metrics['best_val_ppl']:.3f} "
                f"@ epoch {metrics['best_epoch']})")

    def random_inputs(self, dataset: DictConfig, n: int) -> Tensor:
        """``n`` random token blocks of the dataset's length (saved bytes depend on shapes only)."""
        return torch.randint(int(dataset.num_classes), (n, int(dataset.seq_len)))


def task_of(cfg: DictConfig) -> Task:
    """The run's task: ``dataset.task`` (image datasets: classification), which the model config's
    ``task`` must match (a model config without one is a classifier)."""
    data_task = str(cfg.dataset.get("task") or "classification")
    model_task = str(cfg.model.get("task") or "classification")
    if data_task not in TASKS:
        raise ValueError(f"dataset.task must be one of {list(TASKS)}, got {data_task!r}")
    if model_task != data_task:
        raise ValueError(f"model {cfg.model.name!r} ({model_task}) does not fit dataset {cfg.dataset.name!r} "
                         f"({data_task}); choose a {data_task} model")
    smoothing = float(cfg.get("label_smoothing", 0.0))
    return CausalLM(smoothing) if data_task == "causal_lm" else Classification(smoothing)
