"""CPU runs of lessmem.experiment.run on tiny data: outputs, determinism, resume, errors, CLI sweeps, W&B."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import lessmem.experiment.train as train_mod
from lessmem.cli.train import train_main
from lessmem.core import CompressionPlan
from lessmem.experiment import compose_config
from lessmem.experiment.paths import conf_dir
from lessmem.experiment.train import TIME_KEYS, run


@pytest.fixture(scope="module")
def make_cfg(tiny_cifar: tuple[str, ...]) -> Callable[..., object]:
    """``make_cfg(out_dir, *overrides)``: two tiny epochs on the real CIFAR-10 subset."""
    def make(out_dir: Path, *overrides: str):
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return compose("train", overrides=[*tiny_cifar, "epochs=2", f"out_dir={out_dir}", *overrides])

    return make


def comparable(metrics: dict) -> dict:
    """Metrics without wall-clock fields."""
    out = {k: v for k, v in metrics.items() if k not in TIME_KEYS}
    out["history"] = [{k: v for k, v in h.items() if k not in TIME_KEYS} for h in metrics["history"]]
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, make_cfg) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("straight")
    return out, run(make_cfg(out, "grad_cosine_every=2"))


def test_smoke_outputs(straight: tuple[Path, dict]) -> None:
    out, metrics = straight
    for name in ("config.yaml", "metrics.jsonl", "checkpoint.pt", "metrics.json", "grad_cosine.jsonl"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "metrics.json").read_text())
    assert saved == json.loads(json.dumps(metrics))
    assert saved["epochs"] == 2 and len(saved["history"]) == 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    for key in ("final_top1", "final_top5", "best_top1"):
        assert 0.0 <= saved[key] <= 1.0
    assert saved["final_top5"] >= saved["final_top1"]
    assert 0 < saved["saved_bytes"] < saved["stock_saved_bytes"] and 0 < saved["ratio"] < 1
    assert saved["train_time_s"] > 0 and saved["history"][0]["throughput_img_s"] > 0
    h = saved["history"][0]
    assert h["lr"] == pytest.approx(0.1) and saved["history"][1]["lr"] < 0.1  # cosine
    assert 0.0 < h["grad_cosine_mean"] <= 1.0 + 1e-5 and "layer1.0.conv1" in h["grad_cosine"]


def test_same_seed_same_metrics(straight: tuple[Path, dict], tmp_path: Path, make_cfg) -> None:
    again = run(make_cfg(tmp_path, "grad_cosine_every=2"))
    assert comparable(again) == comparable(straight[1])


def test_resume_after_interruption_matches_straight_run(
    straight: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_cfg) -> None:
    _interrupted_in_epoch_2(make_cfg(tmp_path, "grad_cosine_every=2"), monkeypatch)
    assert not (tmp_path / "metrics.json").exists()
    assert (tmp_path / "checkpoint.pt").is_file()
    resumed = run(make_cfg(tmp_path, "grad_cosine_every=2", "resume=true"))
    assert comparable(resumed) == comparable(straight[1])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_resume_extends_finished_run(straight: tuple[Path, dict], tmp_path: Path, make_cfg) -> None:
    run(make_cfg(tmp_path, "epochs=1"))
    more = run(make_cfg(tmp_path, "epochs=2", "resume=true"))
    assert [h["epoch"] for h in more["history"]] == [1, 2]
    # The cosine is stretched to the new horizon: half-way, not at the old run's final lr of 0.
    assert more["history"][1]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (["model.name=nope"], ValueError, "unknown model 'nope'; available: .*resnet20"),
        (["dataset.root=/nonexistent/cifar10"], FileNotFoundError, "ImageFolder layout.*download=true"),
        (["+compression.map.nolayer=2"], ValueError, "does not fit model 'resnet20'.*'nolayer'.*match no"),
        (["compression=none", "++compression.map={conv1: 0}"], ValueError, "kernel size 0 must be >= 1"),
        (["resume=true"], FileNotFoundError, "no checkpoint at"),
        (["precision=fp16"], ValueError, "fp16 needs CUDA"),
    ],
)
def test_clear_errors(tmp_path: Path, overrides: list[str], error: type, match: str, make_cfg) -> None:
    with pytest.raises(error, match=match):
        run(make_cfg(tmp_path, *overrides))


def test_bf16_and_map_file(tmp_path: Path, make_cfg) -> None:
    map_file = tmp_path / "map.yaml"
    map_file.write_text('map:\n  "layer3.*": 4\n  "*": 2\n')
    # bf16 kernels are slow on a CPU: batches of 8, 8 images to validate
    m = run(make_cfg(tmp_path / "run", "precision=bf16", "epochs=1", "max_steps_per_epoch=2", "batch_size=8",
                     "eval_batch_size=8", "dataset.val_subset=8", f"compression.map_file={map_file}", "logger=csv"))
    assert m["epochs"] == 1 and m["ratio"] < 1
    assert (tmp_path / "run" / "metrics.csv").is_file()


def test_cli_multirun_over_compression(tmp_path: Path, tiny, run_cli) -> None:
    sweep = tmp_path / "sweep"
    result = run_cli(train_main, "lessmem-train", "-m", *tiny, "compression=none,pool2,pool4",
                     "dataset.size=32", "dataset.val_size=16", "batch_size=16", f"hydra.sweep.dir={sweep}")
    assert result.status == 0, result.stderr[-30:]
    results = sorted(sweep.glob("*/metrics.json"))
    assert len(results) == 3, result.stderr[-20:]
    by_name = {json.loads(p.read_text())["compression"]: json.loads(p.read_text()) for p in results}
    assert set(by_name) == {"none", "pool2", "pool4"}
    assert by_name["none"]["ratio"] == 1.0
    assert by_name["pool4"]["saved_bytes"] < by_name["pool2"]["saved_bytes"] < by_name["none"]["saved_bytes"]


def test_cli_unknown_group_option_is_clear(tmp_path: Path, run_cli) -> None:
    result = run_cli(train_main, "lessmem-train", "compression=nope", f"hydra.run.dir={tmp_path}")
    assert result.status != 0 and "Could not find 'compression/nope'" in "\n".join(result.stderr)


@pytest.mark.slow
def test_wandb_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny: tuple[str, ...]) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # CI exports WANDB_MODE=disabled
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    out = tmp_path / "run"
    metrics = run(compose_config([*tiny, "logger=wandb", "logger.mode=offline", f"out_dir={out}"]))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(out.rglob("*"))[:20]
    assert (out / "wandb_id.txt").read_text().strip() in runs[0].name
    assert any(runs[0].glob("*.wandb"))
    assert metrics["epochs"] == 1


def test_coverage_report_written_and_logged_as_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      tiny: tuple[str, ...]) -> None:
    from lessmem.experiment.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    tables: dict[str, list[dict]] = {}
    original = WandbLogger.table

    def spy(self, key, records):
        tables[key] = records
        original(self, key, records)

    monkeypatch.setattr(WandbLogger, "table", spy)
    out = tmp_path / "run"
    run(compose_config([*tiny, "logger=wandb", "logger.mode=offline", "compression=pool4", "coverage=true",
                        f"out_dir={out}"]))
    for name in ("coverage.csv", "coverage.json", "coverage.png"):
        assert (out / name).stat().st_size > 0
    rows = tables["coverage"]
    assert {"layer", "op", "bytes", "compressed", "how", "why"} <= set(rows[0])
    assert any(r["how"] == "pooled 4x4" for r in rows)
    assert any(not r["compressed"] and "BatchNorm input" in r["why"] for r in rows)


@pytest.mark.slow
def test_compile_true_trains(tmp_path: Path, tiny: tuple[str, ...]) -> None:
    """compile=true: the compressed layers are traced as custom ops (minutes of compile on CPU)."""
    metrics = run(compose_config([*tiny, "compile=true", f"out_dir={tmp_path}"]))
    assert metrics["epochs"] == 1 and 0.0 <= metrics["final_top1"] <= 1.0


def test_adaptive_schedule_reassigns_kernels_within_budget(tmp_path: Path, make_cfg) -> None:
    import lessmem
    from lessmem.models import build_model

    out = tmp_path / "adaptive"
    metrics = run(make_cfg(out, "adaptive.every=1", "adaptive.budget=0.6", "adaptive.probe_batch=16",
                           "adaptive.storages=[native]", "adaptive.norm_storages=[]", "adaptive.act_storages=[]",
                           "adaptive.from_bn=false", "compression=none"))
    changes = [json.loads(line) for line in (out / "adaptive.jsonl").read_text().splitlines()]
    assert [c["epoch"] for c in changes] == [0, 1]  # epochs=2, re-measured every epoch
    for c in changes:
        assert c["predicted_ratio"] <= 0.6
        assert c["map"] and all(int(k) > 1 for k in c["map"].values()) and c["norm_storage"] == "native"
        assert 0.0 < c["cosine"] < 1.0
    assert metrics["epochs"] == 2
    # The checkpoint carries the map in force, and resume re-applies it.
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["adaptive_plan"] is not None
    model = build_model("resnet20", num_classes=10)
    lessmem.compress(model, CompressionPlan.from_dict(ckpt["adaptive_plan"]))
    kernels = {n: str(s.kernel[0]) for n, s in lessmem.compressed_layers(model).items() if s.kernel[0] > 1}
    assert kernels == changes[-1]["map"]


def test_adaptive_probe_is_a_fixed_training_batch(tmp_path: Path, make_cfg) -> None:
    """The adaptive schedule chooses from the first un-augmented training batch of the run's seed
    (what lessmem-sensitivity measures on), never from the validation images it is scored on."""
    from lessmem.experiment import fixed_batches
    from lessmem.experiment.spec import resolve_run

    cfg = make_cfg(tmp_path, "adaptive.every=1", "adaptive.probe_batch=8")
    spec = resolve_run(cfg)
    x, y = spec.data.probe(8, spec.seed)
    fx, fy = fixed_batches(cfg.dataset, 1, 8, "train", spec.seed)[0]
    assert torch.equal(x, fx) and torch.equal(y, fy)
    vx, _ = fixed_batches(cfg.dataset, 1, 8, "val", spec.seed)[0]
    assert x.shape == vx.shape and not torch.equal(x, vx)


def test_adaptive_start_keeps_the_given_map_until_its_epoch(tmp_path: Path, make_cfg) -> None:
    """adaptive.start=1: no re-choice before epoch 0 (it trains the given compression), the first
    before epoch 1; a negative start is refused before anything runs."""
    out = tmp_path / "start"
    metrics = run(make_cfg(out, "compression=pool2", "adaptive.every=1", "adaptive.start=1", "adaptive.budget=0.6",
                           "adaptive.probe_batch=16", "adaptive.storages=[native]", "adaptive.norm_storages=[]",
                           "adaptive.act_storages=[]", "adaptive.from_bn=false"))
    changes = [json.loads(line) for line in (out / "adaptive.jsonl").read_text().splitlines()]
    assert [c["epoch"] for c in changes] == [1] and metrics["epochs"] == 2
    with pytest.raises(ValueError, match="adaptive.start must be >= 0"):
        run(make_cfg(tmp_path / "bad", "adaptive.every=1", "adaptive.start=-1"))


def test_adaptive_menu_rechooses_map_and_storages_within_budget(tmp_path: Path, make_cfg) -> None:
    """The whole menu re-measured each time, map and BatchNorm storages chosen
    within the total-saved-bytes budget (the run measures what the knapsack predicted), and resume
    re-applies the choice in force."""
    import lessmem
    from lessmem.models import build_model

    out = tmp_path / "adaptive_menu"
    over = ["adaptive.every=1", "adaptive.budget=0.3", "adaptive.probe_batch=4",
            "adaptive.kernels=[1,2]", "adaptive.storages=[native,int8,int4]", "adaptive.norm_storages=[int8,int4]",
            "adaptive.criterion=grad_error", "compression=none"]
    metrics = run(make_cfg(out, *over))
    changes = [json.loads(line) for line in (out / "adaptive.jsonl").read_text().splitlines()]
    assert [c["epoch"] for c in changes] == [0, 1] and metrics["epochs"] == 2
    stock_bytes = metrics["stock_saved_bytes"]
    for c in changes:
        assert c["predicted_ratio"] <= 0.3 and c["criterion"] == "grad_error"
        assert c["saved_bytes"] / stock_bytes == pytest.approx(c["predicted_ratio"])  # probe batch == memory batch
        assert c["map"] and c["norm_storage"] != "native"
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    model = build_model("resnet20", num_classes=10)
    lessmem.compress(model, CompressionPlan.from_dict(ckpt["adaptive_plan"]))
    x = torch.randn(4, 3, 32, 32)
    ratio = lessmem.measure_memory(model, x).ratio_to(lessmem.measure_memory(build_model("resnet20", num_classes=10), x))
    assert ratio == pytest.approx(changes[-1]["predicted_ratio"])


def test_channels_last_and_epoch_callback(straight: tuple[Path, dict], tmp_path: Path, make_cfg) -> None:
    """NHWC training keeps the same saved bytes and trains as well (same loss to float noise);
    on_epoch_end sees every epoch's record after its checkpoint."""
    seen = []

    def callback(epoch: int, record: dict) -> None:
        assert (tmp_path / "checkpoint.pt").is_file()
        seen.append((epoch, record["val_top1"]))

    m = run(make_cfg(tmp_path, "channels_last=true", "grad_cosine_every=2"), on_epoch_end=callback)
    ref = straight[1]
    assert [e for e, _ in seen] == [1, 2] and seen[-1][1] == m["final_top1"]
    assert m["saved_bytes"] == ref["saved_bytes"]
    assert m["history"][0]["train_loss"] == pytest.approx(ref["history"][0]["train_loss"], rel=1e-3)


def _int4_run_cfg(compose, tiny: tuple[str, ...], out_dir: Path, *overrides: str):
    """Two tiny synthetic epochs with every layer's saved input pooled 2x2 in 4-bit codes (and the
    norms' inputs too): each step draws stochastic-rounding noise."""
    cfg = compose(*tiny, "epochs=2", f"out_dir={out_dir}", *overrides)
    cfg.compression.map = {"*": "2/int4"}
    cfg.compression.norm_storage = "int4"
    return cfg


def _final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "checkpoint.pt", weights_only=True)["model"]


def _interrupted_in_epoch_2(cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``cfg`` until its second evaluation, after epoch 1's checkpoint (and epoch 2's steps)."""
    calls = {"n": 0}
    evaluate = train_mod.evaluate

    def crash_in_epoch_2(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated interruption")
        return evaluate(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(train_mod, "evaluate", crash_in_epoch_2)
        with pytest.raises(KeyboardInterrupt):
            run(cfg)


@pytest.mark.slow
def test_resumed_int4_run_draws_the_same_rounding_noise(compose, tiny, tmp_path, monkeypatch) -> None:
    """The checkpoint carries the rounding stream's counter: resumed after epoch 1, a 4-bit run ends
    with the uninterrupted run's weights, bit for bit; restarted from the seed's stream instead, it
    does not (so the noise the counter picks reaches the weights)."""
    run(_int4_run_cfg(compose, tiny, tmp_path / "straight"))
    straight = _final_weights(tmp_path / "straight")

    _interrupted_in_epoch_2(_int4_run_cfg(compose, tiny, tmp_path / "resumed"), monkeypatch)
    ckpt = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["rng"]["rounding"]["calls"] > 0
    run(_int4_run_cfg(compose, tiny, tmp_path / "resumed", "resume=true"))
    resumed = _final_weights(tmp_path / "resumed")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)

    del ckpt["rng"]["rounding"]  # as a checkpoint from before the stream was saved
    torch.save(ckpt, tmp_path / "resumed" / "checkpoint.pt")
    run(_int4_run_cfg(compose, tiny, tmp_path / "resumed", "resume=true"))
    restarted = _final_weights(tmp_path / "resumed")
    assert not all(torch.equal(straight[k], restarted[k]) for k in straight)
