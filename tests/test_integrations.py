"""The fine-tuning callbacks end to end on the CPU, a few steps each: the HF ``Trainer`` on the tiny
LoRA Llama of test_peft.py and a random-token dataset, and a Lightning ``Trainer`` on a tiny token
model; each compresses the model on the first batch, trains to a finite loss and logs saved bytes
below stock's through the trainer's own loggers; a plan of recomputed layers (exact) ends on stock's
weights under either trainer. Skipped without the ``finetune`` extra."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_peft import BATCH, TOKENS, VOCAB, lora_llama
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lessmem
from lessmem.integrations import BatchCall, CompressionSchedule
from lessmem.integrations.schedule import optimizer_like, output_is_loss

transformers = pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")
hf = pytest.importorskip("lessmem.integrations.hf")
lightning = pytest.importorskip("lessmem.integrations.lightning")

SAVED, STOCK, PEAK = "lessmem/saved_bytes", "lessmem/stock_saved_bytes", "lessmem/step_peak_bytes"


def token_rows(n: int) -> Tensor:
    return torch.randint(0, VOCAB, (n, TOKENS), generator=torch.Generator().manual_seed(2))


def hf_trainer(tmp_path: Path, model: nn.Module, steps: int = 3, save_steps: int | None = None) -> Any:
    rows = token_rows(3 * BATCH)
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {"save_strategy": "no"}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=1e-3,
        logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, remove_unused_columns=False, seed=0,
        **saving)
    return transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])


def test_hf_trainer_compresses_a_lora_model_and_logs_through_the_trainer(tmp_path: Path) -> None:
    model = lora_llama()
    trainer = hf_trainer(tmp_path, model)
    # saved_storage gives the model hooks of its own, attached inside its forward's pre-hooks
    plan = lessmem.CompressionPlan({"*lora_A*": "int8", "*lora_B*": "int8"}, act_storage="int8",
                                   saved_storage={"*self_attn": "int8"})
    callback = hf.LessmemCallback(trainer, plan)
    trainer.add_callback(callback)
    trainer.train()
    assert any(".lora_A." in name for name in lessmem.compressed_layers(model))
    assert type(model.get_submodule("base_model.model.model.layers.0.mlp.act_fn")).__name__.startswith("Stored")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    (figures,) = [e for e in trainer.state.log_history if SAVED in e]
    assert 0 < figures[SAVED] < figures[STOCK] and figures[PEAK] > 0 and figures["step"] == 1
    print(f"HF Trainer, LoRA Llama {BATCH}x{TOKENS}, A/B inputs and SiLU inputs int8: saved {figures[SAVED]:.0f} "
          f"of stock's {figures[STOCK]:.0f} bytes, step peak {figures[PEAK]:.0f}")


def trainable(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_weights(got: dict[str, Tensor], stock: dict[str, Tensor]) -> None:
    assert got.keys() == stock.keys()
    for name, value in stock.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_hf_trainer_trains_recomputed_layers_as_stock_does(tmp_path: Path) -> None:
    """Decoder layers recomputed in backward under the Trainer's hooks (what a budget fit may choose):
    they keep fewer bytes, and three steps end on stock's weights (recompute is exact)."""
    after = {}
    for name in ("stock", "recompute"):
        model = lora_llama()
        trainer = hf_trainer(tmp_path / name, model)
        if name == "recompute":
            plan = lessmem.CompressionPlan(recompute=("base_model.model.model.layers.*",))
            trainer.add_callback(hf.LessmemCallback(trainer, plan))
        trainer.train()
        after[name] = trainable(model)
    (figures,) = [e for e in trainer.state.log_history if SAVED in e]
    assert 0 < figures[SAVED] < figures[STOCK]
    assert_same_weights(after["recompute"], after["stock"])


def fit_again(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a resumed budget callback fitted its plan again")


def test_hf_trainer_resumes_a_budget_run_on_its_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Trainer checkpoint holds the plan in force: resumed from it, a budget's plan goes on
    without ``lessmem.fit`` (a budget stock fits here: the cheapest fit, the same path)."""
    first = None
    for steps in (3, 5):
        trainer = hf_trainer(tmp_path, lora_llama(), steps=steps, save_steps=3)
        callback = hf.LessmemCallback(trainer, memory_budget=2**40, measure_peak=False)
        trainer.add_callback(callback)
        trainer.train(resume_from_checkpoint=first is not None)
        if first is None:
            first = callback
            assert (tmp_path / "checkpoint-3" / hf.SCHEDULE_FILE).is_file()
            monkeypatch.setattr("lessmem.integrations.schedule.fit", fit_again)
    assert callback.schedule.plan == first.schedule.plan and first.schedule.plan.name == "budget_1TiB"
    assert callback.schedule.plans == first.schedule.plans + 1


@pytest.mark.slow
def test_hf_trainer_fits_a_budget_on_a_lora_model_and_rechooses(tmp_path: Path) -> None:
    """``memory_budget`` on the LoRA model: ``lessmem.fit`` with the Trainer's AdamW on the first batch,
    then at step 2 a re-choice from the menu on the trained weights, within the first plan's bytes."""
    model = lora_llama()
    trainer = hf_trainer(tmp_path, model)
    trainer.create_optimizer()
    call = BatchCall(model, ((), {"input_ids": token_rows(BATCH), "labels": token_rows(BATCH)}), hf.model_loss)
    stock = lessmem.fit(call, (call.inputs, call.inputs), 2**40, loss_fn=output_is_loss,
                        optimizer=optimizer_like(trainer.optimizer))
    budget = int(0.95 * stock.stock_step_peak_bytes)
    trainer.add_callback(hf.LessmemCallback(trainer, memory_budget=budget, adapt_every=2))
    trainer.train()
    chosen = [e for e in trainer.state.log_history if SAVED in e]
    assert [(e["step"], e["lessmem/plans"]) for e in chosen] == [(1, 1.0), (3, 2.0)]
    assert chosen[0]["lessmem/budget_step_peak_bytes"] <= budget
    assert all(e[SAVED] <= chosen[0][SAVED] < chosen[0][STOCK] for e in chosen)
    assert any(".lora_" in name for name in lessmem.compressed_layers(model))
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)
    print(f"HF Trainer, LoRA Llama, budget {budget} (stock step peak {stock.stock_step_peak_bytes}): step peaks "
          f"{[e[PEAK] for e in chosen]}, saved {[e[SAVED] for e in chosen]} of stock's {chosen[0][STOCK]:.0f}")


class TinyTokenModel(pl.LightningModule):
    """Embedding, three GELU MLPs on (batch, tokens, width) and a head: next-token loss."""

    def __init__(self, dict_loss: bool = False, manual: bool = False) -> None:
        super().__init__()
        blocks = [m for _ in range(3) for m in (nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))]
        self.net = nn.Sequential(nn.Embedding(VOCAB, 64), *blocks, nn.Linear(64, VOCAB))
        self.dict_loss = dict_loss
        self.automatic_optimization = not manual

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor | dict[str, Tensor]:
        (ids,) = batch
        logits = self.net(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return {"loss": loss} if self.dict_loss else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit_lightning(tmp_path: Path, module: pl.LightningModule, callback: pl.Callback,
                  steps: int = 3, resume: Path | None = None) -> list[dict[str, str]]:
    """Train up to step ``steps`` on batches of 8 (from checkpoint ``resume`` if given) and save
    ``tmp_path/last.ckpt``; the rows of the CSV logger's metrics file."""
    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[callback], default_root_dir=tmp_path,
                         logger=pl.loggers.CSVLogger(tmp_path), log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(token_rows(8 * steps)), batch_size=8), ckpt_path=resume)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    with (Path(trainer.logger.log_dir) / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_lightning_applies_a_preset_and_logs_to_its_loggers(tmp_path: Path) -> None:
    module = TinyTokenModel()
    rows = fit_lightning(tmp_path, module, lightning.LessmemCallback(preset="lossy_int8"))
    assert set(lessmem.compressed_layers(module)) == {n for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    (figures,) = [r for r in rows if r.get(SAVED)]
    assert 0 < float(figures[SAVED]) < float(figures[STOCK]) and float(figures[PEAK]) > 0
    print(f"Lightning, tiny token model 8x{TOKENS}, preset lossy_int8: saved {figures[SAVED]} of stock's "
          f"{figures[STOCK]} bytes")


def test_lightning_fits_a_budget_rechooses_every_step_and_resumes_on_its_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory_budget`` between the menu's floor and stock's whole-step peak: ``lessmem.fit`` on the
    first batch, then ``adapt_every=1`` re-measures the menu and re-chooses at every later step,
    within the saved bytes the budget's plan reached. Resumed from the trainer's checkpoint, the
    callback goes on with the plan in force there, without fitting again."""
    module = TinyTokenModel(dict_loss=True)
    call = BatchCall(module, [token_rows(8)], lightning.step_loss(torch.enable_grad))
    stock = lessmem.fit(call, (call.inputs, call.inputs), 2**40, loss_fn=output_is_loss,
                        optimizer=optimizer_like(module.configure_optimizers()))
    budget = int(0.85 * stock.stock_step_peak_bytes)
    callback = lightning.LessmemCallback(memory_budget=budget, adapt_every=1, measure_peak=False)
    rows = fit_lightning(tmp_path, TinyTokenModel(dict_loss=True), callback)
    chosen = [r for r in rows if r.get(SAVED)]
    assert [float(r["lessmem/plans"]) for r in chosen] == [1.0, 2.0, 3.0]
    first = chosen[0]
    assert float(first["lessmem/memory_budget_bytes"]) == budget
    assert float(first["lessmem/budget_step_peak_bytes"]) <= budget
    for r in chosen:
        assert float(r[SAVED]) <= float(first[SAVED]) < float(first[STOCK])
    assert not any(r.get(PEAK) for r in rows)
    print(f"Lightning, budget {budget} (stock step peak {stock.stock_step_peak_bytes}): fit's step peak "
          f"{first['lessmem/budget_step_peak_bytes']}, saved {[r[SAVED] for r in chosen]} of stock's {first[STOCK]}")
    assert callback.schedule.plan is not None and callback.schedule.plan.compresses

    monkeypatch.setattr("lessmem.integrations.schedule.fit", fit_again)
    resumed = lightning.LessmemCallback(memory_budget=budget, measure_peak=False)
    fit_lightning(tmp_path / "resumed", TinyTokenModel(dict_loss=True), resumed, steps=5, resume=tmp_path / "last.ckpt")
    assert resumed.schedule.plan == callback.schedule.plan and resumed.schedule.plans == callback.schedule.plans + 1
    assert resumed.schedule.ratio == callback.schedule.ratio


def test_lightning_trains_recomputed_layers_as_stock_does(tmp_path: Path) -> None:
    """Two MLP blocks' layers recomputed in backward under Lightning's hooks: fewer bytes kept, stock's
    weights after three steps."""
    plan = lessmem.CompressionPlan(recompute=("net.1+net.2+net.3", "net.4+net.5+net.6"))
    after = {}
    for name, callback in (("stock", pl.Callback()), ("recompute", lightning.LessmemCallback(plan))):
        torch.manual_seed(0)
        module = TinyTokenModel()
        rows = fit_lightning(tmp_path / name, module, callback)
        after[name] = trainable(module)
    (figures,) = [r for r in rows if r.get(SAVED)]
    assert 0 < float(figures[SAVED]) < float(figures[STOCK])
    assert_same_weights(after["recompute"], after["stock"])


@pytest.mark.parametrize("make", [lambda **kw: hf.LessmemCallback(None, **kw), lightning.LessmemCallback],
                         ids=["hf", "lightning"])
def test_a_map_and_a_budget_together_are_an_error(make: Any) -> None:
    with pytest.raises(ValueError, match="give one plan, a preset or a memory_budget.*got plan and memory_budget"):
        make(plan={"*": 2}, memory_budget="1GiB")


@pytest.mark.parametrize("options, message", [
    ({}, "got none"),
    ({"preset": "no_such_preset"}, "no compression preset 'no_such_preset'.*pool2"),
    ({"plan": {"*": "2/int9"}}, "unknown storage 'int9'"),
    ({"plan": {"*": 2}, "adapt_every": 2}, "adapt_every re-chooses within a memory_budget"),
    ({"memory_budget": "1GiB", "adapt_every": 0}, "adapt_every re-chooses within a memory_budget"),
    ({"memory_budget": "lots"}, "memory size"),
])
def test_a_schedule_checks_what_it_is_given(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompressionSchedule(**options)


def test_a_batch_without_labels_is_a_clear_error() -> None:
    call = BatchCall(lora_llama(), ((), {"input_ids": token_rows(2)}), hf.model_loss)
    with pytest.raises(ValueError, match="the batches need labels"):
        call(call.inputs)


def test_a_batch_without_a_batch_dimension_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="without a tensor with a batch dimension"):
        BatchCall(nn.Linear(2, 2), {"scale": torch.tensor(2.0), "steps": 3}, hf.model_loss)


def test_lightning_manual_optimization_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="automatic_optimization = False"):
        fit_lightning(tmp_path, TinyTokenModel(manual=True), lightning.LessmemCallback({"*": "int8"}), steps=1)
