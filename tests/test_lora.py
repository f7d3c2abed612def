"""``experiment=lora_quick``: a tiny lm_quick run's checkpoint fine-tuned with LoRA (``model.lora``,
``model.init_checkpoint``) on the stdlib's docstrings (``dataset.source=docstrings``): the run starts
from the checkpoint's weights, trains the adapters alone, reports val_ppl, and compresses like any
model against stock LoRA. Skipped without peft (the ``finetune`` extra)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lessmem.cli.train import train_main
from lessmem.experiment import compose_config, model_spec
from lessmem.experiment.data.text import stdlib_text
from lessmem.experiment.train import run

pytest.importorskip("peft")
pytest.importorskip("transformers")

BASE_PREFIX = "base_model.model."  # what peft.get_peft_model puts before every module name


def lora_overrides(tiny_lm: tuple[str, ...], checkpoint: Path) -> list[str]:
    """``tiny_lm`` on experiment=lora_quick: the same tiny Llama, 0.1 MB of docstrings."""
    return ["experiment=lora_quick", *tiny_lm[1:], "dataset.size_mb=0.1", f"model.init_checkpoint={checkpoint}"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tiny_lm: tuple[str, ...]) -> tuple[Path, dict]:
    """A tiny lm_quick run: its checkpoint and metrics."""
    out_dir = tmp_path_factory.mktemp("lm_quick")
    metrics = run(compose_config([*tiny_lm, f"out_dir={out_dir}"]))
    return out_dir / "checkpoint.pt", metrics


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory, tiny_lm: tuple[str, ...],
              base: tuple[Path, dict]) -> dict[str, tuple[Path, dict]]:
    out = {}
    for compression in ("none", "lossy_int8"):
        out_dir = tmp_path_factory.mktemp(f"lora_{compression}")
        overrides = [*lora_overrides(tiny_lm, base[0]), f"compression={compression}", f"out_dir={out_dir}"]
        out[compression] = out_dir, run(compose_config(overrides))
    return out


def as_base_key(name: str) -> str:
    """A LoRA model's state_dict key of a base weight as the base model names it."""
    return name.removeprefix(BASE_PREFIX).replace(".base_layer.", ".")


def test_lora_quick_composes() -> None:
    cfg = compose_config(["experiment=lora_quick", "compression=lossy_int8", "seed=1"])
    assert cfg.model.name == "tiny_llama" and cfg.model.init_checkpoint == "outputs/lm_quick_seed0/checkpoint.pt"
    assert cfg.model.lora.r == 8 and "down_proj" in cfg.model.lora.target_modules
    assert cfg.dataset.source == "docstrings" and cfg.dataset.seq_len == compose_config(["experiment=lm_quick"]).dataset.seq_len
    assert cfg.compression.name == "lossy_int8" and cfg.seed == 1


def test_lora_run_starts_from_the_checkpoint_and_trains_only_adapters(
        base: tuple[Path, dict], lora_runs: dict[str, tuple[Path, dict]]) -> None:
    out_dir, metrics = lora_runs["none"]
    pretrained = torch.load(base[0], weights_only=True)["model"]
    tuned = torch.load(out_dir / "checkpoint.pt", weights_only=True)["model"]
    adapters = {k: v for k, v in tuned.items() if ".lora_" in k}
    frozen = {as_base_key(k): v for k, v in tuned.items() if ".lora_" not in k}
    assert frozen.keys() == pretrained.keys() and len(adapters) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for key, weight in frozen.items():  # loaded, then never changed by training
        assert torch.equal(weight, pretrained[key]), key
    assert all(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)  # peft starts them at zero
    assert metrics["dataset"] == "stdlib_text" and math.isfinite(metrics["final_val_ppl"]) and metrics["final_val_ppl"] > 1
    assert metrics["final_val_ppl"] == pytest.approx(math.exp(metrics["final_val_loss"]))


def test_lossy_int8_saves_bytes_against_stock_lora(base: tuple[Path, dict],
                                                   lora_runs: dict[str, tuple[Path, dict]]) -> None:
    stock, lossy = (json.loads((lora_runs[c][0] / "memory.json").read_text()) for c in ("none", "lossy_int8"))
    assert stock["ratio"] == 1 and lossy["stock_saved_bytes"] == stock["saved_bytes"] != base[1]["saved_bytes"]
    assert lossy["ratio"] < 0.5 and any(".lora_A." in name for name in lossy["saved_bytes_per_layer"])
    assert math.isfinite(lora_runs["lossy_int8"][1]["final_val_ppl"])


def test_missing_init_checkpoint_is_one_error(tmp_path: Path, tiny_lm: tuple[str, ...],
                                              run_cli: Callable[..., object]) -> None:
    missing = tmp_path / "lm_run" / "checkpoint.pt"
    result = run_cli(train_main, "lessmem-train", *lora_overrides(tiny_lm, missing), f"hydra.run.dir={tmp_path / 'run'}")
    assert result.is_one_error("lessmem-train", f"no checkpoint at {missing}; train the base model first "
                               f"(experiment=lora_quick's: lessmem-train experiment=lm_quick hydra.run.dir={missing.parent})")


def test_another_models_checkpoint_is_one_error(base: tuple[Path, dict], tiny_lm: tuple[str, ...]) -> None:
    cfg = compose_config([*lora_overrides(tiny_lm, base[0]), "model.hidden_size=32"])
    with pytest.raises(ValueError, match="does not fit the model .CausalLM.: Error.s. in loading state_dict"):
        model_spec(cfg.model).build()


def test_docstrings_are_prose_split_by_file_without_test_suites(tmp_path: Path) -> None:
    """Each file's docstrings in source order; files without any, files that do not parse and test
    suites left out before the split counts files."""
    sources = {"a.py": '"""Module a."""\ndef f():\n    """Does f.\n\n    Really."""\n',
               "b.py": "x = 1  # no docstring\n", "c.py": "def (:\n", "d.py": 'class D:\n    """Class d."""\n',
               "e.py": '"""Module e."""\n', "test/t.py": '"""A test."""\n'}
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    data = {"root": str(tmp_path), "source": "docstrings", "size_mb": 1, "val_every": 3, "seq_len": 4}
    train, val = stdlib_text(data)
    assert bytes(train.tokens.tolist()) == b"Module a.\n\nDoes f.\n\nReally.\n\nClass d.\n\n"
    assert bytes(val.tokens.tolist()) == b"Module e.\n\n" and (train.files, val.files) == (2, 1)
    with pytest.raises(ValueError, match="source one of code, docstrings; got .* source=comments"):
        stdlib_text({**data, "source": "comments"})
