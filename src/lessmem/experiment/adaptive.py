"""Adaptive compression schedule: re-assign kernels during training from measured fidelity."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import Tensor, nn

from lessmem.core import measure_memory
from lessmem.experiment.compression import compress_from_config
from lessmem.layer_sensitivity import append_history, sensitivity

log = logging.getLogger(__name__)


def adapt_compression(net: nn.Module, probe: tuple[Tensor, Tensor], acfg: Any, cfg: DictConfig,
                      epoch: int, x_memory: Tensor, out_dir: Path, logger: Any,
                      is_main: bool, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> dict[str, int]:
    """Adaptive schedule: re-measure every conv's weight-gradient fidelity on the fixed probe
    batch (with the run's loss) and re-assign kernels greedily within the memory budget (most bytes saved per
    fidelity lost). Deterministic, so every DDP rank arrives at the same map."""
    device = next(net.parameters()).device
    was_training = net.training
    net.train()
    result = sensitivity(net, [(probe[0].to(device), probe[1].to(device))],
                         kernels=[int(k) for k in acfg.get("kernels", (1, 2, 4, 8))], loss_fn=loss_fn)
    budget = acfg.get("budget")
    mapping = result.make_map(None if budget is None else float(budget), acfg.get("min_cosine"))
    compress_from_config(net, mapping, cfg)
    net.train(was_training)
    change = {
        "epoch": epoch, "conv_input_bytes": result.saved_bytes(mapping),
        "conv_input_bytes_uncompressed": result.baseline_bytes(),
        "mean_grad_cosine": result.mean_cosine(mapping),
        "saved_bytes": measure_memory(net, x_memory.to(device)).total_bytes,
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
