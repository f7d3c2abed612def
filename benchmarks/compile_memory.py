"""Whole-step peak of a tiny Llama (``model=tiny_llama``, lm_quick's memory batch: 16 x 128 byte
tokens, AdamW, fp32, CPU), stock against everything int8 (``compression=lossy_int8``), eager
against ``torch.compile``: ``lessmem.measure_step_memory`` after two warm-up steps. Prints each
peak, the ratio to stock in each mode and the split by category as JSON (docs/compile.md).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/compile_memory.py
"""

from __future__ import annotations

import copy
import json
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

import lessmem
from lessmem.core import measure_step_memory, set_rounding_seed
from lessmem.models.causal_lm import tiny_llama

LOSSY_INT8 = {"norm_storage": "int8", "act_storage": "int8", "saved_storage": "int8", "exact_companions": True}


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    warnings.simplefilter("ignore")  # int8 linear inputs run their eager Function compiled: one warning each
    torch.manual_seed(0)
    stock = tiny_llama(256).train()
    ids = torch.randint(0, 256, (16, 129))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    rows = {}
    for name in ("stock", "lossy_int8"):
        model = copy.deepcopy(stock)
        if name == "lossy_int8":
            lessmem.compress(model, {"*": "int8"}, **LOSSY_INT8)
        for mode in ("eager", "compiled"):
            set_rounding_seed(0)
            m = copy.deepcopy(model)
            optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3)
            report = measure_step_memory(torch.compile(m) if mode == "compiled" else m, batch,
                                         optimizer=optimizer, loss_fn=loss_fn, warmup_steps=2)
            rows[f"{name}/{mode}"] = {"peak_MiB": report.peak_bytes / 2**20, "phase": report.phase,
                                      "by_category_MiB": {k: v / 2**20 for k, v in report.by_category.items()}}
            print(name, mode, f"peak {report.peak_bytes / 2**20:.2f} MiB", report.phase, flush=True)
    for mode in ("eager", "compiled"):
        ratio = rows[f"lossy_int8/{mode}"]["peak_MiB"] / rows[f"stock/{mode}"]["peak_MiB"]
        print(f"{mode}: lossy_int8 whole-step peak / stock = {ratio:.3f}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
