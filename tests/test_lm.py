"""The language-model path: the stdlib_text dataset (deterministic, split by file, random blocks per
epoch), tiny_llama runs through ``run(cfg)`` stock and pooled (val_ppl, memory, resume), the task
check, and sensitivity on token linears with the next-token loss."""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lessmem
import lessmem.experiment.train as train_mod
from lessmem.cli.sensitivity import main as sensitivity_main
from lessmem.experiment import compose_config, coverage_for_config, fixed_batches, task_of
from lessmem.experiment.data import RandomBlockLoader, SequentialBlockLoader, build_loaders
from lessmem.experiment.data.text import stdlib_text, text_files
from lessmem.experiment.task import TokenCrossEntropy
from lessmem.experiment.train import TIME_KEYS, run
from lessmem.models import build_model
from lessmem.sensitivity import MenuOptions, measure_menu

pytest.importorskip("transformers")

DATA = {"name": "stdlib_text", "root": None, "size_mb": 1, "val_every": 10, "seq_len": 32, "val_blocks": 16}


def source_tree(root: Path, sizes: list[int]) -> Path:
    """Files ``f00.py``, ``f01.py``, ... of the given sizes, each filled with its own letter, and an
    installed package the dataset must skip."""
    for i, size in enumerate(sizes):
        (root / f"f{i:02d}.py").write_bytes(bytes([ord("a") + i]) * size)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "pkg.py").write_bytes(b"z" * 100)
    return root


def test_stdlib_text_is_deterministic_and_split_by_file() -> None:
    train, val = stdlib_text(DATA)
    again_train, again_val = stdlib_text(DATA)
    assert torch.equal(train.tokens, again_train.tokens) and torch.equal(val.tokens, again_val.tokens)
    assert 0.7e6 < len(train.tokens) + len(val.tokens) < 1.2e6  # whole files up to 1 MB
    assert train.files > 5 * val.files > 0


def test_split_takes_every_val_every_th_file_and_skips_packages(tmp_path: Path) -> None:
    root = source_tree(tmp_path, [40] * 6)
    assert [p.name for p in text_files(root)] == [f"f{i:02d}.py" for i in range(6)]
    train, val = stdlib_text({**DATA, "root": str(root), "val_every": 3, "seq_len": 8})
    assert bytes(val.tokens.tolist()) == b"c" * 40 + b"f" * 40
    assert bytes(train.tokens.tolist()) == b"".join(bytes([c]) * 40 for c in b"abde")
    limited, _ = stdlib_text({**DATA, "root": str(root), "val_every": 3, "seq_len": 8, "size_mb": 100e-6})
    assert limited.files == 2  # f00, f01, f02 reach 100 bytes: f02 is validation


def test_empty_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"no train block of 33 bytes from the .py files under {tmp_path}"):
        stdlib_text({**DATA, "root": str(tmp_path)})


def test_random_blocks_are_seeded_per_epoch_and_shifted_by_one() -> None:
    train_loader, val_loader = build_loaders(DATA, 4, 8, seed=3, max_steps=3)
    first = list(train_loader)
    assert len(first) == 3 and first[0][0].shape == (4, 32) and first[0][0].dtype == torch.int64
    for x, y in first:
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, train_loader, strict=True))
    train_loader.set_epoch(1)
    assert not torch.equal(next(iter(train_loader))[0], first[0][0])
    val = torch.cat([x for x, _ in val_loader])
    assert len(val) == 16 and torch.equal(val, torch.cat([x for x, _ in val_loader]))
    other_seed, _ = build_loaders(DATA, 4, 8, seed=4, max_steps=3)
    assert not torch.equal(next(iter(other_seed))[0], first[0][0])


def test_block_shards_of_two_ranks_equal_one_process(tmp_path: Path) -> None:
    train, val = stdlib_text({**DATA, "root": str(source_tree(tmp_path, [300] * 6)), "val_every": 3, "seq_len": 8})
    full = list(RandomBlockLoader(train, 6, seed=1, max_steps=4))
    shards = [list(RandomBlockLoader(train, 3, seed=1, max_steps=4, rank=r, world_size=2)) for r in range(2)]
    for step, (x, y) in enumerate(full):
        assert torch.equal(torch.cat([shards[0][step][0], shards[1][step][0]]), x)
        assert torch.equal(torch.cat([shards[0][step][1], shards[1][step][1]]), y)
    # 74 validation blocks in batches of 2 x 4: the last global batch leaves rank 1 without rows.
    one = torch.cat([x for x, _ in SequentialBlockLoader(val, 8)])
    ranks = [list(SequentialBlockLoader(val, 4, rank=r, world_size=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) + 1
    assert sorted(map(tuple, torch.cat([x for part in ranks for x, _ in part]).tolist())) == sorted(
        map(tuple, one.tolist()))


def test_fixed_batches_are_a_training_loaders_first_batches(tiny_lm: tuple[str, ...]) -> None:
    cfg = compose_config([*tiny_lm, "seed=5"])
    loader, _ = build_loaders(cfg.dataset, 4, 8, seed=5, max_steps=2)
    for (x, y), (fx, fy) in zip(loader, fixed_batches(cfg.dataset, 2, 4, seed=5), strict=True):
        assert torch.equal(x, fx) and torch.equal(y, fy)


def comparable(metrics: dict) -> dict:
    out = {k: v for k, v in metrics.items() if k not in TIME_KEYS}
    out["history"] = [{k: v for k, v in h.items() if k not in TIME_KEYS} for h in metrics["history"]]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_lm: tuple[str, ...]) -> dict[str, tuple[Path, dict]]:
    out = {}
    for name, overrides in (("stock", ["compression=none"]), ("pool2", ["compression=pool2"])):
        out_dir = tmp_path_factory.mktemp(name)
        out[name] = out_dir, run(compose_config([*tiny_lm, *overrides, "epochs=2", f"out_dir={out_dir}"]))
    return out


def test_lm_run_reports_perplexity_not_accuracy(runs: dict[str, tuple[Path, dict]]) -> None:
    for _, metrics in runs.values():
        assert metrics["task"] == "causal_lm" and metrics["epochs"] == 2
        assert math.isfinite(metrics["final_val_ppl"]) and metrics["final_val_ppl"] > 1
        assert metrics["final_val_ppl"] == pytest.approx(math.exp(metrics["final_val_loss"]))
        assert metrics["final_val_ppl"] < 256  # better than uniform over bytes after 8 steps
        assert not any("top1" in k or "top5" in k for k in metrics)
        assert not any("top" in k for h in metrics["history"] for k in h)
        assert all(h["throughput_tok_s"] > 0 for h in metrics["history"])


def test_lm_memory_is_measured_on_a_text_batch(runs: dict[str, tuple[Path, dict]]) -> None:
    out_dir, metrics = runs["pool2"]
    memory = json.loads((out_dir / "memory.json").read_text())
    assert memory["memory_batch"] == 4 and memory["compression_map"] == {"*": 2}
    assert 0 < memory["ratio"] < 1 and memory["step_peak_ratio"] < 1
    assert any(".mlp.down_proj" in name for name in memory["saved_bytes_per_layer"])
    assert runs["stock"][1]["ratio"] == pytest.approx(1.0)
    assert metrics["stock_saved_bytes"] == runs["stock"][1]["saved_bytes"]


def test_lm_resume_matches_straight_run(runs: dict[str, tuple[Path, dict]], tiny_lm: tuple[str, ...], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = [*tiny_lm, "compression=pool2", "epochs=2", f"out_dir={tmp_path}"]
    evaluate, calls = train_mod.evaluate, []

    def crash_in_epoch_2(*args: object, **kwargs: object) -> dict:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated interruption")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(train_mod, "evaluate", crash_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        run(compose_config(overrides))
    monkeypatch.setattr(train_mod, "evaluate", evaluate)
    resumed = run(compose_config([*overrides, "resume=true"]))
    assert comparable(resumed) == comparable(runs["pool2"][1])


def test_task_mismatch_is_a_clear_error(tiny_lm: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match=r"model 'resnet20' \(classification\) does not fit dataset "
                                         r"'stdlib_text' \(causal_lm\); choose a causal_lm model"):
        task_of(compose_config(["experiment=lm_quick", "model=resnet20"]))
    cfg = compose_config(list(tiny_lm))
    cfg.dataset.task = "translation"
    with pytest.raises(ValueError, match=r"dataset.task must be one of \['classification', 'causal_lm'\], "
                                         r"got 'translation'"):
        task_of(cfg)


def test_lm_needs_the_zoo_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="model 'tiny_gpt2' needs HF transformers.*'zoo' extra"):
        build_model("tiny_gpt2", 256)


SMALL_LMS = {
    "tiny_llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "max_position_embeddings": 32},
    "tiny_gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 32, "resid_pdrop": 0.0,
                  "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}


@pytest.mark.parametrize("name", list(SMALL_LMS))
def test_sensitivity_predicts_the_pooled_lm_gradients(name: str, tiny_lm: tuple[str, ...]) -> None:
    """One stock backward with the next-token loss predicts each token linear's pooled weight gradient."""
    torch.manual_seed(0)
    cfg = compose_config(list(tiny_lm))
    model = build_model(name, 256, **SMALL_LMS[name])
    x, y = fixed_batches(cfg.dataset, 1, 4)[0]
    res = measure_menu(model.train(), [(x, y)], MenuOptions.kernel_only((1, 2)), loss_fn=task_of(cfg).criterion)
    items = {i.name: i for i in res.items if i.kind == "linear"}
    stock, pooled = copy.deepcopy(model), copy.deepcopy(model)
    lessmem.compress(pooled, {"*": 2})
    for net in (stock, pooled):
        TokenCrossEntropy()(net(x), y).backward()
    tied = {"lm.lm_head"} if name == "tiny_gpt2" else set()  # its weight is the embedding's too
    checked = [n for n in items if n not in tied]
    assert len(checked) >= 6
    for layer in checked:
        g_stock, g_pooled = (net.get_submodule(layer).weight.grad.flatten() for net in (stock, pooled))
        assert F.cosine_similarity(g_stock, g_pooled, dim=0).item() == pytest.approx(
            items[layer].mean("cosine")[1], abs=1e-4), layer
    assert all(i.mean("cosine")[0] == pytest.approx(1.0, abs=1e-6) for i in items.values())
    kept = [n for n, _ in model.named_modules() if n.endswith(("o_proj", "attn.c_proj"))]  # attention output: kept anyway
    assert kept and not set(kept) & set(items)  # nothing to choose there: not on the menu
    assert res.uniform("2")["ratio"] < 1


def test_sensitivity_cli_on_the_lm(tmp_path: Path, run_cli: Callable[..., object], tiny_lm: tuple[str, ...]) -> None:
    result = run_cli(sensitivity_main, "lessmem-sensitivity", *tiny_lm, "sensitivity.batches=2",
                     "sensitivity.batch_size=4", f"sensitivity.out={tmp_path}", "menu=kernels", "menu.kernels=[1,2]",
                     "sensitivity.budget=0.9")
    assert result.status == 0, result.stderr
    table = json.loads((tmp_path / "menu.json").read_text())
    assert "lm.model.layers.0.mlp.down_proj" in [i["name"] for i in table["items"]]
    generated = tmp_path / "menu_tiny_llama.yaml"
    overrides = [*tiny_lm, f"compression.map_file={generated}", f"out_dir={tmp_path / 'run'}", "epochs=1"]
    assert math.isfinite(run(compose_config(overrides))["final_val_ppl"])


def test_coverage_of_the_lm_runs_on_token_blocks(tiny_lm: tuple[str, ...]) -> None:
    report = coverage_for_config(compose_config([*tiny_lm, "compression=pool2"]))
    summary = report.summary()
    assert 0 < summary["compressed_bytes"] < summary["total_bytes"] < summary["stock_bytes"]


def test_adaptive_plan_applies_its_saved_region_storages(tmp_path: Path, tiny_lm: tuple[str, ...]) -> None:
    """The adaptive schedule hands the run the menu's whole plan: saved-region storages (norm
    inputs, attention's q / k / v) are applied, so the bytes measured right after it equal the
    menu's prediction (a plan without them keeps those tensors full size), and the checkpoint
    carries them for resume."""
    out = tmp_path / "adaptive"
    metrics = run(compose_config([*tiny_lm, f"out_dir={out}", "compression=none", "adaptive.every=1",
                                  "adaptive.budget=0.45", "adaptive.probe_batch=4", "adaptive.kernels=[1]",
                                  "adaptive.storages=[native,int8]", "adaptive.norm_storages=[]",
                                  "adaptive.act_storages=[]", "adaptive.saved_storages=[int4]",
                                  "adaptive.from_bn=false"]))
    (change,) = [json.loads(line) for line in (out / "adaptive.jsonl").read_text().splitlines()]
    assert change["saved_storage"] != "native"
    assert change["saved_bytes"] / metrics["stock_saved_bytes"] == pytest.approx(change["predicted_ratio"])
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["adaptive_plan"]["saved_storage"] == change["saved_storage"]
