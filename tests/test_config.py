"""Configs: every option of every Hydra config group composes, and a map file is a complete choice.

Compose every option of every Hydra config group and build what it describes.

A map file is a complete choice: it never runs without the exact companions unless asked, its
name labels the run, and the record carries the map and its hash (issue 23)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lessmem.cli.train import train_main
from lessmem.core import STORAGES, compress
from lessmem.experiment import run
from lessmem.experiment.compression import resolve_compression
from lessmem.experiment.data import build_datasets, build_loaders
from lessmem.experiment.loggers import CsvLogger, Logger, build_logger
from lessmem.experiment.paths import conf_dir
from lessmem.experiment.spec import LogSpec, OptimSpec
from lessmem.experiment.task import task_of
from lessmem.models import MODELS, build_model

CONF = conf_dir()
CIFAR = Path(__file__).parents[1].parent / "shared/data/cifar10"
# Big ImageNet-style nets get one forward at 32x32 only (enough to catch wiring errors, fast);
# models with a fixed input size are listed here.
FIXED_INPUT = {"vit_b_16": 224}
# Compression options are tried on these until one fits (maps are model-specific).
MAP_TARGETS = ("resnet20", "resnet18_cifar", "vit_tiny_cifar", "resnet18", "resnet50", "mobilenet_v2", "vgg11_bn")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def groups() -> list[str]:
    return sorted(p.name for p in CONF.iterdir() if p.is_dir())


@pytest.fixture(autouse=True)
def hydra_ctx():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def test_default_config_composes() -> None:
    cfg = compose("train")
    assert cfg.model.name == "resnet20" and cfg.dataset.name == "cifar10"
    assert cfg.compression.name == "none" and cfg.logger.name == "wandb" and cfg.logger.mode == "offline"
    assert cfg.out_dir is None and cfg.resume is False
    OmegaConf.to_container(cfg, resolve=True)  # no `hydra:` interpolation outside the CLI


def test_every_group_has_options() -> None:
    expected = {"model", "dataset", "compression", "optimizer", "scheduler", "logger", "experiment"}
    assert expected <= set(groups())
    for g in expected:
        assert options(g), g


@pytest.mark.parametrize("name", options("model"))
def test_model_option_builds_and_runs(name: str) -> None:
    cfg = compose("train", overrides=[f"model={name}"])
    language_model = cfg.model.get("task") == "causal_lm"
    if language_model:
        pytest.importorskip("transformers")
        cfg = compose("train", overrides=[f"model={name}", "dataset=stdlib_text"])
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k not in ("name", "task")}
    model = build_model(cfg.model.name, **kwargs).eval()
    size = FIXED_INPUT.get(name, 32)
    batch = 1 if size > 64 else 2
    x = task_of(cfg).random_inputs(cfg.dataset, batch) if language_model else torch.randn(batch, 3, size, size)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (*x.shape[:2], cfg.dataset.num_classes) if language_model else (batch, cfg.dataset.num_classes)


def test_models_registry_covers_configs_and_rejects_unknown() -> None:
    assert set(options("model")) <= set(MODELS)
    with pytest.raises(ValueError, match="unknown model 'nope'.*resnet20"):
        build_model("nope", 10)


def test_resnet20_shape() -> None:
    model = build_model("resnet20", 10)
    assert 0.26e6 < sum(p.numel() for p in model.parameters()) < 0.28e6  # He et al.: 0.27M
    assert any(isinstance(m, torch.nn.ReLU) for m in model.modules())
    b = build_model("resnet20", 10, shortcut="B")
    assert sum(p.numel() for p in b.parameters()) > sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", options("dataset"))
def test_dataset_option(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LESSMEM_CACHE", str(tmp_path / "cache"))
    if name == "stdlib_text":  # text: token blocks and their next tokens (tests/test_lm.py has more)
        cfg = compose("train", overrides=[f"dataset={name}", "dataset.size_mb=0.5", "model=tiny_llama"])
        x, y = next(iter(build_loaders(cfg.dataset, 8, 16, seed=0)[0]))
        assert x.shape == y.shape == (8, cfg.dataset.seq_len) and x.dtype == torch.int64
        assert int(x.max()) < cfg.model.num_classes == 256
        return
    over = [f"dataset={name}", "dataset.train_subset=20", "dataset.val_subset=10"]
    if name == "imagenet":
        over.append(f"dataset.root={tmp_path / 'missing'}")
    cfg = compose("train", overrides=over)
    assert cfg.model.num_classes == cfg.dataset.num_classes
    if name == "imagenet":  # no ImageNet on these machines: the error must say where to put it
        with pytest.raises(FileNotFoundError, match="ImageFolder layout"):
            build_datasets(cfg.dataset)
        return
    if name == "cifar10" and not CIFAR.is_dir():
        pytest.skip(f"CIFAR-10 not found at {CIFAR}")
    train_loader, val_loader = build_loaders(cfg.dataset, 8, 16, seed=0)
    x, y = next(iter(train_loader))
    size = cfg.dataset.image_size
    assert x.shape == (8, 3, size, size) and x.dtype == torch.float32 and y.shape == (8,)
    assert len(train_loader.data) == 20 and len(val_loader.data) == 10
    assert abs(x.mean().item()) < 1.5  # normalized


@pytest.mark.parametrize("name", options("compression"))
def test_compression_option_applies(name: str) -> None:
    import lessmem

    cfg = compose("train", overrides=[f"compression={name}"])
    choice = resolve_compression(cfg.compression)
    errors = []
    for model_name in MAP_TARGETS:  # the first model the map fits (every pattern must match)
        model = build_model(model_name, 10)
        try:
            compress(model, choice)
            break
        except ValueError as e:
            errors.append(f"{model_name}: {e}")
    else:
        pytest.fail(f"compression={name} fits none of {MAP_TARGETS}:\n" + "\n".join(errors))
    if any(v != 1 for v in choice.map.values()):
        assert lessmem.compressed_layers(model)
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()


def test_paper_map_uses_coarser_downsample() -> None:
    import lessmem

    cfg = compose("train", overrides=["compression=paper_resnet18"])
    model = lessmem.compress(build_model("resnet18_cifar", 10), resolve_compression(cfg.compression).map)
    layers = lessmem.compressed_layers(model)
    assert layers["layer2.0.downsample.0"].kernel == (4, 4)
    assert layers["conv1"].kernel == (2, 2) and layers["layer1.0.conv1"].kernel == (2, 2)
    assert "fc" not in layers


@pytest.mark.parametrize("wrapped", [True, False])
def test_map_file_overrides_map(tmp_path: Path, wrapped: bool) -> None:
    body = '"layer1.*": 4\n"*": 2\n'
    text = "map:\n" + "".join("  " + line + "\n" for line in body.splitlines()) if wrapped else body
    path = tmp_path / "map.yaml"
    path.write_text(text)
    cfg = compose("train", overrides=["compression=pool4", f"compression.map_file={path}"])
    assert resolve_compression(cfg.compression).map == {"layer1.*": 4, "*": 2}


@pytest.mark.parametrize("name", options("optimizer"))
def test_optimizer_option(name: str) -> None:
    cfg = compose("train", overrides=[f"optimizer={name}"])
    optim = OptimSpec(OmegaConf.to_container(cfg.optimizer), OmegaConf.to_container(cfg.scheduler))
    opt = optim.optimizer_for(build_model("resnet20", 10).parameters())
    assert opt.param_groups[0]["lr"] == cfg.optimizer.lr
    assert {k: v for k, v in opt.defaults.items() if k in cfg.optimizer} == {
        k: tuple(v) if k == "betas" else v for k, v in cfg.optimizer.items() if not k.startswith("_")}


@pytest.mark.parametrize("name", options("scheduler"))
def test_scheduler_option(name: str) -> None:
    cfg = compose("train", overrides=[f"scheduler={name}", "scheduler.warmup_epochs=1"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    optim = OptimSpec(OmegaConf.to_container(cfg.optimizer), OmegaConf.to_container(cfg.scheduler))
    sched = optim.schedule(opt, epochs=4, steps_per_epoch=10)
    lrs = []
    for _ in range(40):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warmup
    assert lrs[-1] < 1.0 if name == "cosine" else lrs[-1] == pytest.approx(1.0)


@pytest.mark.parametrize("name", options("logger"))
def test_logger_option(name: str, tmp_path: Path) -> None:
    cfg = compose("train", overrides=[f"logger={name}"])
    if cfg.logger.name == "wandb":  # the offline/online init itself is covered in test_train
        assert cfg.logger.mode in ("offline", "online") and cfg.logger.project == "lessmem"
        cfg.logger.mode = "disabled"
    logger = build_logger(LogSpec(OmegaConf.to_container(cfg.logger), every_steps=0),
                          OmegaConf.to_container(cfg), tmp_path, resume=False)
    assert isinstance(logger, Logger)
    logger.log({"epoch": 1, "val/top1": 0.5})
    logger.finish()
    if isinstance(logger, CsvLogger):
        assert (tmp_path / "metrics.csv").read_text().splitlines()[0] == "epoch,val/top1"


@pytest.mark.parametrize("name", options("experiment"))
def test_experiment_option(name: str) -> None:
    cfg = compose("train", overrides=[f"experiment={name}"])
    base = compose("train")
    assert cfg != base
    build_model(cfg.model.name, cfg.model.num_classes)
    resolve_compression(cfg.compression)  # the map resolves and checks
    if name == "cpu_quick":
        assert cfg.epochs == 1 and cfg.dataset.train_subset == 2000 and cfg.logger.name == "disabled"
        assert cfg.model.name == "resnet20" and cfg.batch_size == 64
    if name == "paper_resnet18":
        assert cfg.epochs == 200 and cfg.model.name == "resnet18_cifar"


def test_conf_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LESSMEM_CONF", str(tmp_path))
    assert conf_dir() == tmp_path.resolve()


def test_configs_ship_in_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import lessmem

    monkeypatch.delenv("LESSMEM_CONF", raising=False)
    assert conf_dir() == (Path(lessmem.__file__).parent / "conf").resolve()
    repo_conf = Path(__file__).parents[1] / "conf"  # the checkout's view: a symlink to them
    assert repo_conf.resolve() == conf_dir()


def test_lessmem_info_lists_choices(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lessmem.cli.info import main

    assert main([]) == 0
    out = capsys.readouterr().out
    for name in ("resnet20", "vit_tiny_cifar", "pool2", "paper_resnet18", "synthetic", "adamw", "cosine",
                 "wandb", "cpu_quick", "slurm_gpu", str(conf_dir())):
        assert name in out, name
    # the spec syntax of map values, with every storage
    assert "k/STORAGE" in out and all(f"  {storage}  " in out for storage in STORAGES)
    assert main(["--json", "compression"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["groups"]) == {"compression"} and "pool4" in info["groups"]["compression"]
    assert tuple(info["storages"]) == STORAGES and "khxkw" in info["spec_syntax"]
    assert set(MODELS) == set(info["architectures"])
    assert main(["nope"]) == 2 and "unknown group" in capsys.readouterr().err


def test_every_option_has_a_one_sentence_description() -> None:
    from lessmem.cli.info import config_options

    incomplete = {f"{group}={option}": text for group, options in config_options().items()
                  for option, text in options.items() if not text.endswith((".", "!", "?"))}
    assert not incomplete, incomplete
    assert set(config_options()["optimizer"]) == set(options("optimizer"))


def test_storage_options_reach_the_run(compose, tiny) -> None:
    """act_storage / saved_storage are compression settings like norm_storage: composed, recorded,
    applied, and part of the choice's hash only when lossy (older runs keep their hashes)."""
    import torch

    from lessmem.core import measure_memory
    from lessmem.experiment.compression import resolve_compression
    from lessmem.models import build_model

    plain = resolve_compression(compose(*tiny).compression)
    lossy = resolve_compression(compose(*tiny, "compression.saved_storage=int8", "compression.act_storage=bf16").compression)
    assert (lossy.saved_storage, lossy.act_storage) == ("int8", "bf16")
    assert plain.record()["saved_storage"] == "native" and lossy.record()["saved_storage"] == "int8"
    assert lossy.digest != plain.digest
    assert plain.digest == resolve_compression(compose(*tiny, "compression.saved_storage=native").compression).digest
    x = torch.randn(4, 3, 32, 32)
    nets = []
    for choice in (plain, lossy):
        torch.manual_seed(0)
        net = build_model("resnet20", num_classes=10).train()
        compress(net, choice)
        nets.append(measure_memory(net, x).total_bytes)
    assert nets[1] < nets[0]


@pytest.fixture
def half_map(tmp_path: Path) -> Path:
    path = tmp_path / "half.yaml"
    path.write_text("'*': 2\n")
    return path


def test_map_file_on_the_stock_preset_keeps_the_companions(compose, half_map: Path) -> None:
    from_file = resolve_compression(compose(f"compression.map_file={half_map}").compression)
    preset = resolve_compression(compose("compression=pool2").compression)
    assert from_file.name == "half" and from_file.exact_companions and from_file.map == {"*": 2}
    assert from_file.digest == preset.digest  # the same choice, asked for two ways
    assert resolve_compression(compose("compression=none").compression).exact_companions is False


def test_the_file_labels_the_run_not_the_preset(compose, tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: greedy_0.4\nexact_companions: false\nmap:\n  '*': 2\n")
    choice = resolve_compression(compose("compression=pool2", f"compression.map_file={path}").compression)
    assert choice.name == "greedy_0.4" and choice.exact_companions is False and choice.source == str(path)
    assert choice.digest != resolve_compression(compose("compression=pool2").compression).digest


def test_run_records_the_map_and_its_label(compose, tiny, half_map: Path, tmp_path: Path) -> None:
    metrics = run(compose(*tiny, "compression=none", f"compression.map_file={half_map}",
                          f"out_dir={tmp_path / 'run'}"))
    assert metrics["compression"] == "half" and metrics["compression_map"] == {"*": 2}
    assert metrics["exact_companions"] is True and metrics["ratio"] < 0.7
    assert len(metrics["compression_hash"]) == 10
    # The whole training step's peak is recorded beside the saved bytes (issue 22).
    assert 0 < metrics["step_peak_bytes"] < metrics["stock_step_peak_bytes"]
    assert metrics["step_peak_ratio"] == metrics["step_peak_bytes"] / metrics["stock_step_peak_bytes"]


def test_a_run_keeping_more_than_stock_says_so(compose, tiny, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "naive.yaml"
    path.write_text("name: naive\nexact_companions: false\nmap:\n  '*': 2\n")
    with caplog.at_level(logging.WARNING):
        metrics = run(compose(*tiny, f"compression.map_file={path}", f"out_dir={tmp_path / 'run'}"))
    assert metrics["ratio"] > 1 and metrics["compression"] == "naive"
    assert any("keeps" in r.message and "the stock bytes" in r.message and "exact_companions is off"
               in r.message for r in caplog.records)


def test_command_line_map_string_takes_globs_and_dotted_names(compose) -> None:
    cfg = compose("compression=pool2", 'compression.map="layer1.*:4,layer2.0.conv1:2/int4,*:2"')
    choice = resolve_compression(cfg.compression)
    assert list(choice.map.items()) == [("layer1.*", 4), ("layer2.0.conv1", "2/int4"), ("*", 2)]


def test_command_line_map_as_json_reads_the_same(compose, run_cli, tiny, tmp_path: Path) -> None:
    as_json = resolve_compression(compose('compression.map=\'{"layer1.*": 4, "*": "2/int4"}\'').compression)
    as_pairs = resolve_compression(compose('compression.map="layer1.*:4,*:2/int4"').compression)
    assert list(as_json.map.items()) == [("layer1.*", 4), ("*", "2/int4")] and as_json.digest == as_pairs.digest
    with pytest.raises(ValueError, match="not a valid JSON / YAML mapping"):
        resolve_compression(compose("compression.map='{layer1: [4'").compression)
    # Hydra's own dict syntax adds keys to a fixed node: the error says how to write a map.
    result = run_cli(train_main, "lessmem-train", *tiny, f"out_dir={tmp_path}", "compression.map={conv1:2}")
    assert result.is_one_error("lessmem-train", "write compression.map=")


def test_a_changed_preset_is_labelled_by_what_ran(compose) -> None:
    stock = resolve_compression(compose("compression=pool2").compression)
    changed = resolve_compression(compose("compression=none", 'compression.map="*:int8"').compression)
    assert stock.name == "pool2"
    assert changed.name == f"none+{changed.digest[:6]}" and changed.map == {"*": "int8"}


def test_errors_name_what_the_user_wrote(compose) -> None:
    with pytest.raises(ValueError, match=r"compression.map \{'nolayer': 2\} on top of preset 'pool2'"):
        run(compose("compression=pool2", 'compression.map="nolayer:2,*:2"', "dataset=synthetic"))
    with pytest.raises(ValueError, match="'layer1' maps to .*nested keys; write compression.map="):
        resolve_compression(compose("compression=none", "+compression.map.layer1.conv1=4").compression)
    with pytest.raises(ValueError, match="'layer1.\\*' is not PATTERN:SPEC"):
        resolve_compression(compose('compression.map="layer1.*"').compression)


def test_a_stock_run_has_ratios_of_exactly_one(compose, tiny, tmp_path: Path) -> None:
    m = run(compose(*tiny, "compression=none", f"out_dir={tmp_path}"))
    assert m["compression"] == "none" and m["ratio"] == 1 and m["step_peak_ratio"] == 1
