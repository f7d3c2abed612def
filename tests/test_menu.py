"""The compressor menu (conv, BatchNorm and language-model items), kernel-only and full.

The compressor menu: bytes predicted exactly as measure_memory counts them, the whole-gradient
criterion additive as claimed, the knapsack optimal and within budget, map files round-trip.

lessmem.sensitivity, kernel-only (the menu with native storage): one stock backward predicts
every compressed weight gradient, and the bytes of every map.

The menu of a language model and the menu's 1-bit end: token linears, GELU / SiLU inputs and
saved-tensor regions (norm inputs, attention's saved tensors, gated products) as items, bytes
predicted exactly as measure_memory counts them; 1-bit BatchNorm inputs; the CLI measuring on
warmed-up weights."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lessmem
from lessmem.core import CompressionPlan, load_rounding_state, rounding_state
from lessmem.experiment import compose_config, fixed_batches, run, task_of
from lessmem.experiment.compression import resolve_compression
from lessmem.models import build_model
from lessmem.sensitivity import (
    MenuItem,
    MenuOptions,
    MenuResult,
    measure_menu,
)

KERNELS = (1, 2, 4)
STORAGES = ("native", "bf16", "int8", "int4", "bf16_rn", "int8_rn")


@pytest.fixture(scope="module")
def menu() -> MenuResult:
    options = MenuOptions(kernels=KERNELS, storages=STORAGES, norm_storages=("bf16", "int8", "int2"), from_bn=False)
    return measure_menu(tiny_cnn().train(), batches(), options)


@pytest.fixture(scope="module")
def joint_menu() -> MenuResult:
    """The default menu's from_bn: 3.conv2 reads ReLU(3.bn1) alone, so the two choose together."""
    options = MenuOptions(kernels=(1, 2), storages=("native", "int8", "int2"), norm_storages=("int8", "int2"))
    return measure_menu(tiny_cnn().train(), batches(), options)


def whole_grad(model: torch.nn.Module, batch) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(F.cross_entropy(model(batch[0]), batch[1]), params)
    return torch.cat([g.double().flatten() for g in grads])


def test_items_cover_convs_and_norms(menu: MenuResult) -> None:
    kinds = {(i.name, i.kind) for i in menu.items}
    assert kinds == {("0", "conv"), ("3.conv1", "conv"), ("3.conv2", "conv"), ("3.down", "conv"), ("4", "conv"),
                     ("1", "norm"), ("3.bn1", "norm")}
    shared = {i.name: i.group for i in menu.items if i.kind == "conv"}
    assert shared["3.conv1"] == shared["3.down"] != shared["3.conv2"]
    conv = next(i for i in menu.items if i.name == "3.conv2")
    assert conv.options[:3] == ["1", "bf16", "int8"] and "2/int4" in conv.options
    assert conv.mean("grad_error")[0] == 0.0 and all(v > 0 for v in conv.mean("grad_error")[1:])
    chunked = CompressionPlan({"*": 2}, norm_storage="chunked")  # chunked BatchNorm keeps native's bytes
    assert menu.score(chunked) == menu.score(chunked.replace(norm_storage="native"))


def test_a_conv_after_batchnorm_and_relu_chooses_with_it(joint_menu: MenuResult, menu: MenuResult) -> None:
    """A norm_conv item per conv that can rebuild its input (3.conv2 from 3.bn1; 3.conv1 and 3.down
    share theirs: not offered): every BatchNorm storage with every conv option, and with from_bn,
    which from an exact BatchNorm keeps nothing of the conv's and is exact to rounding."""
    kinds = {(i.name, i.kind) for i in joint_menu.items}
    assert ("3.conv2", "norm_conv") in kinds and ("1", "norm") in kinds and ("3.conv1", "conv") in kinds
    assert not any(i.name == "3.bn1" for i in joint_menu.items)
    joint = next(i for i in joint_menu.items if i.kind == "norm_conv")
    assert joint.partner == "3.bn1" and joint.exact_option == "native|1"
    assert {"native|1", "int2|2/int8", "native|from_bn", "int8|from_bn", "int2|from_bn"} <= set(joint.options)
    exact, rebuilt = joint.index("native|1"), joint.index("native|from_bn")
    apart = {i.name: i for i in menu.items}  # the same model and batches, measured without from_bn
    conv_bytes, norm_bytes = apart["3.conv2"].nbytes[0], apart["3.bn1"].nbytes[0]
    assert (joint.nbytes[exact], joint.nbytes[rebuilt]) == (norm_bytes + conv_bytes, norm_bytes)
    assert joint.mean("grad_error")[rebuilt] < 1e-10 < joint.mean("grad_error")[joint.index("int2|from_bn")]


@pytest.mark.parametrize("seed", range(3))
def test_predicted_bytes_of_maps_with_from_bn_equal_measured(joint_menu: MenuResult, seed: int) -> None:
    """Random choices of every item, from_bn included: the map written back (the conv part to the map,
    the BatchNorm part to norm_storage) saves what the menu predicts, byte for byte, and reads back
    as the same choices."""
    rng = random.Random(seed)
    chosen = {i.name: rng.choice(i.options) for i in joint_menu.items}
    chosen["3.conv2"] = rng.choice(["native|from_bn", "int8|from_bn", "int2|from_bn"])
    for i in joint_menu.items:  # the layers reading one tensor agree
        if i.group is not None:
            chosen[i.name] = chosen[next(j.name for j in joint_menu.items if j.group == i.group)]
    choice = joint_menu.choice_of(chosen)
    assert choice.plan.map["3.conv2"] == "from_bn"
    assert joint_menu.options_of(choice.plan) == chosen
    x = batches()[0][0]
    model = lessmem.compress(tiny_cnn().train(), choice.plan)
    assert choice.score["bytes"] == lessmem.measure_memory(model, x).total_bytes


def test_the_knapsack_rebuilds_where_bytes_are_short(joint_menu: MenuResult) -> None:
    """Below what the menu reaches without from_bn the knapsack must rebuild; the uniform maps
    set the BatchNorm part of a norm_conv item too."""
    without = joint_menu.least_ratio()
    assert joint_menu.make_map(1.0).score["bytes"] == joint_menu.score(CompressionPlan())["bytes"]
    tight = joint_menu.make_map(without * 1.02)
    assert tight.score["ratio"] <= without * 1.02
    uniform = joint_menu.uniform_choice("int8", "int2")
    assert uniform.plan.map["3.conv2"] == "int8" and uniform.plan.norm_storage == {"1": "int2", "3.bn1": "int2"}


@pytest.mark.parametrize("seed", range(4))
def test_predicted_bytes_equal_measured(menu: MenuResult, seed: int) -> None:
    """Random per-layer maps (shared inputs with differing options included): the menu's bytes
    are what measure_memory counts on the compressed model, byte for byte."""
    rng = random.Random(seed)
    model = tiny_cnn().train()
    x = batches()[0][0]
    convs = [i for i in menu.items if i.kind == "conv"]
    mapping = {i.name: rng.choice(i.options) for i in convs}
    norm = {i.name: rng.choice(i.options) for i in menu.items if i.kind == "norm"}
    predicted = menu.score(CompressionPlan(mapping, norm))
    measured = lessmem.measure_memory(lessmem.compress(copy.deepcopy(model), mapping, norm_storage=norm), x)
    stock = lessmem.measure_memory(model, x)
    assert predicted["bytes"] == measured.total_bytes
    assert predicted["ratio"] == pytest.approx(measured.ratio_to(stock))


def test_conv_errors_add_up_to_the_whole_gradient_error(menu: MenuResult) -> None:
    """Conv inputs leave the backward exact, so a map's summed per-item error is the relative
    whole-gradient error of an actual compressed backward (round-to-nearest storages: no noise)."""
    mapping = {"0": "2", "3.conv1": "int8_rn", "3.down": "4/bf16_rn", "3.conv2": "2/int8_rn", "4": "4"}
    errors = []
    for batch in batches():
        model = tiny_cnn().train()
        exact = whole_grad(copy.deepcopy(model), batch)
        approx = whole_grad(lessmem.compress(model, mapping), batch)
        errors.append(float((approx - exact).square().sum() / exact.square().sum()))
    assert menu.score(CompressionPlan(mapping))["grad_error"] == pytest.approx(sum(errors) / len(errors), rel=1e-6)


def test_norm_probe_is_an_actual_compressed_backward(menu: MenuResult) -> None:
    """The probe of a stochastic storage draws the noise of the menu's pass over that batch."""
    errors = []
    state = rounding_state()
    for batch_no, batch in enumerate(batches()):
        model = tiny_cnn().train()
        exact = whole_grad(copy.deepcopy(model), batch)
        load_rounding_state({"seed": 0x5EED + batch_no, "calls": 0})
        approx = whole_grad(lessmem.compress(model, None, norm_storage={"3.bn1": "int8"}), batch)
        load_rounding_state(state)
        errors.append(float((approx - exact).square().sum() / exact.square().sum()))
    item = next(i for i in menu.items if i.name == "3.bn1")
    assert item.mean("grad_error")[item.index("int8")] == pytest.approx(sum(errors) / len(errors), rel=1e-6)
    assert item.mean("grad_error")[item.index("int2")] > item.mean("grad_error")[item.index("int8")] > 0


def tensor_errors(approx: torch.Tensor, exact: torch.Tensor, model: torch.nn.Module) -> float:
    """Mean over parameter tensors with a gradient of ||approx_t - exact_t||^2 / ||exact_t||^2."""
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    errs = [float((a - e).square().sum() / e.square().sum())
            for a, e in zip(approx.split(sizes), exact.split(sizes), strict=True) if e.any()]
    return sum(errs) / len(errs)


def test_tensor_error_is_the_mean_per_tensor_error_of_a_compressed_backward(menu: MenuResult) -> None:
    """``tensor_error`` of a map, conv items (analytic) and a BatchNorm probe (an actual backward)
    alike: each parameter tensor's relative error, averaged over the tensors."""
    mapping = {"0": "2", "3.conv1": "int8_rn", "3.down": "4/bf16_rn", "3.conv2": "2/int8_rn", "4": "4"}
    conv_errors, norm_errors = [], []
    state = rounding_state()
    for batch_no, batch in enumerate(batches()):
        model = tiny_cnn().train()
        exact = whole_grad(copy.deepcopy(model), batch)
        conv_errors.append(tensor_errors(whole_grad(lessmem.compress(copy.deepcopy(model), mapping), batch),
                                         exact, model))
        load_rounding_state({"seed": 0x5EED + batch_no, "calls": 0})
        approx = whole_grad(lessmem.compress(model, None, norm_storage={"3.bn1": "int2"}), batch)
        load_rounding_state(state)
        norm_errors.append(tensor_errors(approx, exact, model))
    assert menu.score(CompressionPlan(mapping))["tensor_error"] == pytest.approx(sum(conv_errors) / len(conv_errors), rel=1e-6)
    item = next(i for i in menu.items if i.name == "3.bn1")
    assert item.mean("tensor_error")[item.index("int2")] == pytest.approx(sum(norm_errors) / len(norm_errors),
                                                                          rel=1e-6)


def test_a_menu_measured_before_a_criterion_scores_without_it(menu: MenuResult) -> None:
    d = menu.to_dict()
    for item in d["items"]:
        del item["criteria"]["tensor_error"]
    old = MenuResult.from_dict(d)
    assert "tensor_error" not in old.criteria and "tensor_error" not in old.score(CompressionPlan({"0": "2"}))
    assert old.score(CompressionPlan({"0": "2"}))["grad_error"] == menu.score(CompressionPlan({"0": "2"}))["grad_error"]
    with pytest.raises(ValueError, match="measured without criterion 'tensor_error'"):
        old.make_map(0.5, "tensor_error")


def test_measurement_leaves_model_and_rounding_stream_alone() -> None:
    model = tiny_cnn().train()
    before = copy.deepcopy(model.state_dict())
    state = rounding_state()
    measure_menu(model, batches(1), MenuOptions(kernels=(1, 2), storages=("native", "int4"), norm_storages=("int4",)))
    assert rounding_state() == state
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(type(m).__module__.startswith("lessmem") for m in model.modules())
    load_rounding_state(state)


@pytest.mark.parametrize("budget", [0.25, 0.4, 0.7])
def test_knapsack_map_fits_and_is_measured_within_budget(menu: MenuResult, budget: float) -> None:
    choice = menu.make_map(budget)
    model = tiny_cnn().train()
    x = batches()[0][0]
    compressed = lessmem.compress(copy.deepcopy(model), choice.plan)
    ratio = lessmem.measure_memory(compressed, x).ratio_to(lessmem.measure_memory(model, x))
    assert ratio <= budget and choice.score["ratio"] == pytest.approx(ratio)


def test_knapsack_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    items = []
    for i in range(5):
        n = rng.randint(2, 4)
        errs = [0.0] + sorted(rng.random() for _ in range(n - 1))
        nbytes = [1000] + sorted((rng.randint(50, 400) for _ in range(n - 1)), reverse=True)
        items.append(MenuItem(f"n{i}", "norm", ["native", "int8", "int4", "int2"][:n], nbytes,
                              {"grad_error": [errs], "loss_change": [errs], "cosine": [[1 - e for e in errs]]}))
    menu = MenuResult(items, stock_bytes=6000, base_bytes=500)
    for budget in (0.45, 0.6, 0.75):
        best = min((sum(it.mean("grad_error")[j] for it, j in zip(items, combo, strict=True)), combo)
                   for combo in itertools.product(*(range(len(it.options)) for it in items))
                   if 500 + sum(it.nbytes[j] for it, j in zip(items, combo, strict=True)) <= budget * 6000)
        choice = menu.make_map(budget, "grad_error")
        assert choice.score["grad_error"] == pytest.approx(best[0])
        assert choice.score["bytes"] <= budget * 6000
        # Weighted (how the menu search steers it): least weighted sum, unweighted score reported.
        weights = {it.name: rng.uniform(0.2, 5.0) for it in items}
        best_w = min((sum(weights[it.name] * it.mean("grad_error")[j] for it, j in zip(items, combo, strict=True)),
                      combo)
                     for combo in itertools.product(*(range(len(it.options)) for it in items))
                     if 500 + sum(it.nbytes[j] for it, j in zip(items, combo, strict=True)) <= budget * 6000)
        weighted = menu.make_map(budget, "grad_error", weights=weights)
        norm = weighted.plan.norm_storage
        chosen = [it.index(norm.get(it.name, "native") if isinstance(norm, dict) else norm) for it in items]
        assert sum(weights[it.name] * it.mean("grad_error")[j] for it, j in zip(items, chosen, strict=True)) \
            == pytest.approx(best_w[0])
        assert weighted.score["grad_error"] == pytest.approx(
            sum(it.mean("grad_error")[j] for it, j in zip(items, chosen, strict=True)))
    assert menu.unit_items() == {it.name: [it.name] for it in items}


def test_bad_requests_say_what_is_wrong(menu: MenuResult) -> None:
    with pytest.raises(ValueError, match="option '8' was not measured"):
        menu.score(CompressionPlan({"*": 8}))
    with pytest.raises(ValueError, match="no map fits 0.010x stock saved bytes; the menu's smallest is"):
        menu.make_map(0.01)
    with pytest.raises(ValueError, match="unknown criterion 'accuracy'"):
        menu.make_map(0.5, "accuracy")
    with pytest.raises(ValueError, match="needs kernel 1 and native storage"):
        MenuOptions(kernels=(2, 4))
    with pytest.raises(ValueError, match="token_kernels"):
        MenuOptions(token_kernels=(2,))
    assert MenuOptions.kernel_only((1, 2)).token_kernels == (1, 2)
    assert MenuOptions.from_config({"token_kernels": ["1", "4"]}).token_kernels == (1, 4)
    assert MenuOptions.from_config({"recompute": True}).recompute and not MenuOptions().recompute
    with pytest.raises(ValueError, match="menu.recompute must be true or false"):
        MenuOptions.from_config({"recompute": "yes"})


def test_menu_and_map_files_round_trip(menu: MenuResult, tmp_path) -> None:
    from PIL import Image

    paths = menu.save(tmp_path)
    with Image.open(paths["png"]) as im:
        im.verify()
    assert len(paths["csv"].read_text().splitlines()) == 1 + sum(len(i.options) for i in menu.items)
    again = MenuResult.load(tmp_path)
    choice = menu.make_map(0.4)
    assert again.make_map(0.4).plan == choice.plan
    path = choice.plan.write(tmp_path / "chosen.yaml", comment="test map")
    read = CompressionPlan.read(path)
    assert read.replace(name="", source="") == choice.plan and read.name == "chosen"
    assert read.digest == choice.plan.digest and menu.score(read) == choice.score
    from omegaconf import OmegaConf

    run_choice = resolve_compression(OmegaConf.create({"map": {}, "map_file": str(path), "norm_storage": "native",
                                                       "act_storage": "native", "exact_companions": None}))
    assert run_choice.digest == choice.plan.digest


def test_cli_menu_writes_measurement_and_a_map_a_run_can_use(tmp_path, run_cli, tiny, compose) -> None:
    from lessmem.cli import sensitivity as cli

    out = tmp_path / "menu"
    result = run_cli(cli.main, "lessmem-sensitivity", "model=resnet20", "dataset=synthetic",
                     "sensitivity.batches=1", "sensitivity.batch_size=4", "menu.kernels=[1,2]",
                     "menu.storages=[native,int2]", "menu.norm_storages=[int2]", "sensitivity.time_steps=0",
                     "sensitivity.budget=0.2", f"sensitivity.out={out}")
    assert result.status == 0, result.stderr
    menu = MenuResult.load(out)
    assert {i.kind for i in menu.items} == {"conv", "norm", "norm_conv"} and menu.meta["weights"] == "random init"
    written = CompressionPlan.read(out / "menu_resnet20.yaml")
    assert menu.score(written)["ratio"] <= 0.2
    cfg = compose(*tiny, f"compression.map_file={out / 'menu_resnet20.yaml'}")
    choice = resolve_compression(cfg.compression)
    assert choice.digest == written.digest
    bad = run_cli(cli.main, "lessmem-sensitivity", "model=resnet20", "dataset=synthetic",
                  "sensitivity.batches=1", "sensitivity.batch_size=4", "sensitivity.criterion=accuracy",
                  f"sensitivity.out={out}")
    assert bad.is_one_error("lessmem-sensitivity", "unknown criterion 'accuracy'")


@pytest.mark.parametrize("seed", range(2))
def test_language_model_menu_predicts_bytes_exactly(seed: int) -> None:
    """Token linears (q / k / v sharing one input, lm_head) and the SiLU inside Llama's recomputed
    gated MLP (whose storage changes nothing there: measured, not assumed)."""
    from lessmem.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny_llama", num_classes=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2).train()
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    loss = lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))  # noqa: E731
    options = MenuOptions(kernels=(1, 2), storages=("native", "int8", "int4"), norm_storages=(), act_storages=("int8",))
    menu = measure_menu(model, [(x, y)], options, loss_fn=loss)
    kinds = {i.kind for i in menu.items}
    assert kinds == {"linear", "act"}
    assert not any(i.name.endswith("o_proj") for i in menu.items)  # kept by attention anyway: nothing to choose
    rng = random.Random(seed)
    mapping = {i.name: rng.choice(i.options) for i in menu.items if i.kind == "linear"}
    act = {i.name: "int8" for i in menu.items if i.kind == "act"}
    measured = lessmem.measure_memory(lessmem.compress(copy.deepcopy(model), mapping, act_storage=act), x)
    assert menu.score(CompressionPlan(mapping, act_storage=act))["bytes"] == measured.total_bytes
    assert menu.make_map(0.7, "grad_error").score["ratio"] <= 0.7


class Block(nn.Module):
    """conv1 and the 1x1 shortcut read the same input, as in ResNet."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, groups=2)
        self.down = nn.Conv2d(cin, cout, 1, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv2(self.relu(self.bn1(self.conv1(x)))) + self.down(x))


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        Block(8, 16),
        nn.Conv2d(16, 16, 3, padding="same", dilation=1, padding_mode="reflect"), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5),
    )


def batches(n: int = 2, size: int = 15) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, size, size, generator=g), torch.randint(5, (4,), generator=g)) for _ in range(n)]


def conv_grads(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    return {n: m.weight.grad.clone() for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}


def kernel_menu(model: nn.Module, data, kernels=(1, 2, 4)) -> MenuResult:
    return measure_menu(model, data, MenuOptions.kernel_only(kernels))


def conv_items(menu: MenuResult) -> dict:
    return {i.name: i for i in menu.items if i.kind == "conv"}


def test_k1_exact_and_pooled_lossy() -> None:
    menu = kernel_menu(tiny_cnn().train(), batches())
    items = conv_items(menu)
    assert list(items) == ["0", "3.conv1", "3.conv2", "3.down", "4"]
    assert {i.kind for i in menu.items} == {"conv", "norm"}  # BatchNorm inputs: native only
    assert all(i.options == ["native"] for i in menu.items if i.kind == "norm")
    for item in items.values():
        assert item.options == ["1", "2", "4"]
        assert item.mean("cosine")[0] == pytest.approx(1.0, abs=1e-6)
        assert item.mean("grad_error")[0] == pytest.approx(0.0, abs=1e-12)
        assert all(c < 1 - 1e-4 for c in item.mean("cosine")[1:])
    # conv1 and down share their input: one group, so a uniform map stores it once.
    assert items["3.conv1"].group == items["3.down"].group
    assert items["3.conv1"].nbytes == [4 * 8 * 15 * 15 * 4, 4 * 8 * 8 * 8 * 4, 4 * 8 * 4 * 4 * 4]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_prediction_matches_compressed_backward(k: int) -> None:
    """The insight: exact error propagation makes one stock pass predict the compressed one."""
    model = tiny_cnn().train()
    batch = batches(1)[0]
    exact = conv_grads(copy.deepcopy(model), batch)
    compressed = copy.deepcopy(model)
    lessmem.compress(compressed, {"*": k})
    actual = conv_grads(compressed, batch)
    for name, item in conv_items(kernel_menu(copy.deepcopy(model), [batch], kernels=(1, k))).items():
        cos = F.cosine_similarity(exact[name].flatten().double(), actual[name].flatten().double(), dim=0)
        assert float(cos) == pytest.approx(item.mean("cosine")[1], abs=1e-5), name


def test_saved_bytes_match_measure_memory() -> None:
    """The menu's bytes of a map are what autograd really keeps under it."""
    model = tiny_cnn().train()
    x = batches(1)[0][0]
    menu = kernel_menu(copy.deepcopy(model), [batches(1)[0]])
    for m in ({"*": 2}, {"3.conv1": 4, "3.down": 2, "4": 2}, {"3.conv1": 2, "0": 4}):
        lessmem.compress(model, m)
        assert menu.score(lessmem.CompressionPlan(m))["bytes"] == lessmem.measure_memory(model, x).total_bytes, m
        lessmem.uncompress(model)


def test_buffers_and_grads_untouched() -> None:
    model = tiny_cnn().train()
    before = copy.deepcopy(model.state_dict())
    kernel_menu(model, batches(1), kernels=(1, 2))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_kernel_map_fits_the_budget_and_compresses() -> None:
    menu = kernel_menu(tiny_cnn().train(), batches(), kernels=(1, 2, 4, 8))
    for frac in (0.9, 0.7, 0.5):
        choice = menu.make_map(frac)
        assert choice.score["ratio"] <= frac
        assert choice.plan.norm_storage == "native" and choice.plan.act_storage == "native"
        assert all(o in ("1", "2", "4", "8") for o in choice.plan.map.values())
        lessmem.compress(tiny_cnn(), choice.plan)  # usable as it is


pytest.importorskip("transformers")

SMALL_LMS = {
    "tiny_llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "max_position_embeddings": 32},
    "tiny_gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 32, "resid_pdrop": 0.0,
                  "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}


def applied(model: torch.nn.Module, choice) -> torch.nn.Module:
    return lessmem.compress(copy.deepcopy(model), choice.plan)


@pytest.fixture(scope="module", params=list(SMALL_LMS))
def lm(request: pytest.FixtureRequest, tiny_lm: tuple[str, ...]) -> tuple[str, torch.nn.Module, tuple, MenuResult]:
    torch.manual_seed(0)
    cfg = compose_config(list(tiny_lm))
    model = build_model(request.param, 256, **SMALL_LMS[request.param]).train()
    batch = fixed_batches(cfg.dataset, 1, 4)[0]
    options = MenuOptions(kernels=(1, 2), token_kernels=(1, 2), storages=("native", "int4", "int1"),
                          act_storages=("int4",), saved_storages=("int8", "int1"))
    menu = measure_menu(model, [batch], options, loss_fn=task_of(cfg).criterion)
    return request.param, model, batch, menu


def test_lm_items_cover_linears_norms_and_attention(lm) -> None:
    name, _, _, menu = lm
    saved = [i.name for i in menu.items if i.kind == "saved"]
    assert {i.kind for i in menu.items} >= {"linear", "saved"}
    norms = ("input_layernorm", "post_attention_layernorm", "model.norm") if name == "tiny_llama" else ("ln_1", "ln_2", "ln_f")
    assert all(any(n.endswith(norm) for n in saved) for norm in norms), saved
    attention = [i for i in menu.items if i.kind == "saved" and i.name.endswith(("self_attn", ".attn"))]
    assert len(attention) == 2
    if name == "tiny_llama":  # every layer saves the rotary tables: the attentions choose together
        assert attention[0].group is not None and attention[0].group == attention[1].group
    for item in (i for i in menu.items if i.kind == "saved"):
        assert item.options == ["native", "int8", "int1"]
        assert item.nbytes[0] > item.nbytes[1] > item.nbytes[2] >= 0


@pytest.mark.parametrize("seed", range(3))
def test_lm_predicted_bytes_equal_measured(lm, seed: int) -> None:
    """Random per-unit choices over the whole menu, applied as the map make_map writes: the menu's
    bytes are measure_memory's, byte for byte."""
    _, model, (x, _), menu = lm
    rng = random.Random(seed)
    chosen = {}
    for members in menu.unit_items().values():
        items = [i for i in menu.items if i.name in members]
        option = rng.choice([o for o in items[0].options if all(o in i.options for i in items)])
        chosen.update(dict.fromkeys(members, option))
    choice = menu.choice_of(chosen)
    assert choice.score["bytes"] == lessmem.measure_memory(applied(model, choice), x).total_bytes


def test_lm_knapsack_maps_fit_and_reach_below_the_linears_alone(lm) -> None:
    _, model, (x, _), menu = lm
    linears_only = menu.uniform("2/int1")["ratio"]
    least = menu.least_ratio()
    assert least < linears_only
    for budget in (0.5, least + 0.01):
        choice = menu.make_map(budget, "grad_error")
        measured = lessmem.measure_memory(applied(model, choice), x).total_bytes
        assert measured == choice.score["bytes"] <= budget * menu.stock_bytes
    with pytest.raises(ValueError, match="no map fits"):
        menu.make_map(least * 0.9)


def test_batchnorm_int1_is_on_the_menu_and_its_bytes_are_exact() -> None:
    model = tiny_cnn().train()
    menu = measure_menu(model, batches(1), MenuOptions(kernels=(1, 2), storages=("native", "int1")))
    bn = next(i for i in menu.items if i.kind == "norm")
    assert bn.options[-1] == "int1" and bn.nbytes[-1] < bn.nbytes[bn.index("int2")]
    without = measure_menu(model, batches(1), MenuOptions(kernels=(1, 2), storages=("native", "int1"),
                                                          norm_storages=("bf16", "int8", "int4", "int2")))
    assert menu.least_ratio() < without.least_ratio()
    choice = menu.uniform_choice("2/int1", "int1")
    x = batches(1)[0][0]
    assert choice.score["bytes"] == lessmem.measure_memory(applied(model, choice), x).total_bytes


def test_sensitivity_cli_measures_the_lm_menu_after_warm_up(tmp_path: Path, run_cli: Callable[..., object],
                                                             tiny_lm: tuple[str, ...]) -> None:
    from lessmem.cli.sensitivity import main

    result = run_cli(main, "lessmem-sensitivity", *tiny_lm, "sensitivity.batches=2", "sensitivity.batch_size=4",
                     "sensitivity.warmup_steps=2", "menu.kernels=[1,2]", "menu.storages=[native,int4]",
                     "menu.norm_storages=[]", "menu.act_storages=[int4]", "menu.saved_storages=[int4,int1]",
                     "sensitivity.budget=0.3", "sensitivity.criterion=grad_error", f"sensitivity.out={tmp_path}")
    assert result.status == 0, result.stderr
    data = json.loads((tmp_path / "menu.json").read_text())
    assert data["meta"]["weights"] == "stock, after 2 warm-up steps"
    assert {i["kind"] for i in data["items"]} == {"linear", "act", "saved"}
    # menu.kernels pools conv inputs; token-linear inputs stay unpooled unless menu.token_kernels says so
    assert data["meta"]["token_kernels"] == [1]
    assert all(i["options"] == ["1", "int4"] for i in data["items"] if i["kind"] == "linear")
    generated = tmp_path / "menu_tiny_llama.yaml"
    assert "saved_storage" in generated.read_text()
    metrics = run(compose_config([*tiny_lm, f"compression.map_file={generated}", f"out_dir={tmp_path / 'run'}"]))
    assert math.isfinite(metrics["final_val_ppl"])
    assert metrics["ratio"] <= 0.3 + 1e-9


def test_menu_recompute_options_predict_bytes_and_trade_time_for_error() -> None:
    """menu.recompute: each decoder layer (and run of layers) offered with measured bytes and
    seconds; a map with regions recomputed predicts measure_memory's bytes byte for byte, its
    items there keep nothing between forward and backward, their rerun storing int8 codes (their
    error counted); under a byte budget
    that int8 codes alone cannot reach, regions make it, within max_step_ratio only; a plan
    recomputing an unmeasured region is refused by name; regions survive the menu file."""
    torch.manual_seed(0)
    model = build_model("tiny_llama", num_classes=64, hidden_size=32, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4).train()  # as conf/model/tiny_llama
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    loss = lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))  # noqa: E731
    options = MenuOptions(kernels=(1,), storages=("native", "int8"), norm_storages=(), act_storages=("int8",),
                          saved_storages=("int8",), recompute=True)
    menu = measure_menu(model, [(x, y)], options, loss_fn=loss)
    layers = [f"lm.model.layers.{i}" for i in range(4)]
    assert set(layers) <= {r.name for r in menu.regions} and menu.meta["step_seconds"] > 0
    assert all(r.freed_bytes > 0 and r.seconds > 0 for r in menu.regions if r.name in layers)
    codes_only = menu.least_ratio()
    with pytest.raises(ValueError, match="no map fits"):
        menu.make_map(0.9 * codes_only)
    chosen = menu.make_map(0.9 * codes_only, max_step_ratio=10.0)
    assert chosen.plan.recompute and chosen.score["ratio"] <= 0.9 * codes_only
    assert 1.0 < chosen.score["step_ratio"] <= 10.0
    exact = CompressionPlan(exact_companions=True)
    for k in range(4):  # byte for byte while a tensor shared by every layer stays kept
        for plan in (dataclasses.replace(chosen.plan, recompute=tuple(layers[:k])),
                     dataclasses.replace(exact, recompute=tuple(layers[:k]))):
            # the attentions' saved tensors, one unit across the layers (they share the rotary
            # table), keep the share of the layers not recomputed
            assert menu.score(plan)["bytes"] == lessmem.measure_memory(lessmem.compress(copy.deepcopy(model), plan), x).total_bytes
    # Every layer recomputed: the rotary tables all attentions save once are gone too; the menu,
    # which counts them with the layers' shared unit, can only overstate.
    measured = lessmem.measure_memory(lessmem.compress(copy.deepcopy(model), chosen.plan), x).total_bytes
    assert measured <= chosen.score["bytes"] <= 1.05 * measured
    everywhere = menu.uniform_choice("int8", act="int8", saved="int8").score
    assert chosen.score["tensor_error"] <= everywhere["tensor_error"]
    inside = [n for n, (o, _) in menu.item_values(chosen.plan).items() if o.startswith("recomputed")]
    assert inside and all(menu.item_values(chosen.plan)[n][0] == "recomputed, int8" for n in inside)
    exact_inside = dataclasses.replace(chosen.plan, map={k: "1" if any(k.startswith(f"{r}.") for r in chosen.plan.recompute)
                                                         else v for k, v in chosen.plan.map.items()})
    assert menu.score(exact_inside)["tensor_error"] < chosen.score["tensor_error"]  # the rerun's codes count
    assert menu.score(exact_inside)["bytes"] == chosen.score["bytes"]  # and keep nothing across the step
    # Not asserted here: that int8 inside lowers the rerun's peak. On this tiny model it does for some
    # regions and not others (the chosen one varies with the timings); docs/proofs.md measures it at size.
    tight = menu.recompute_ladder(1.0 + min(r.seconds for r in menu.regions) / menu.meta["step_seconds"] / 2)
    assert tight == [[]]  # not even one region's rerun fits that step
    with pytest.raises(ValueError, match="did not measure"):
        menu.score(CompressionPlan(recompute=("lm.model.layers.0.mlp",)))
    again = MenuResult.from_dict(json.loads(json.dumps(menu.to_dict())))
    assert again.make_map(0.9 * codes_only, max_step_ratio=10.0).plan == chosen.plan


def test_menu_does_not_offer_regions_that_split_a_rebuilt_input(joint_menu: MenuResult) -> None:
    """A region holding a BatchNorm but not the conv that rebuilds its input from it (a ResNet's
    stem before layer1.0.conv1) is not offered: from_bn would have nothing to rebuild from."""
    options = MenuOptions(kernels=(1, 2), storages=("native", "int8"), norm_storages=("int8",), recompute=True)
    menu = measure_menu(tiny_cnn().train(), batches(1), options)
    pairs = [(i.name, i.partner) for i in menu.items if i.kind == "norm_conv"]
    assert pairs and menu.regions
    for r in menu.regions:
        members = r.name.split("+")
        for conv, norm in pairs:
            assert any(conv == m or conv.startswith(f"{m}.") for m in members) == \
                any(norm == m or norm.startswith(f"{m}.") for m in members), (r.name, conv, norm)
    for ratio in (0.9, 0.6, 0.4):
        plan = menu.make_map(ratio, max_step_ratio=5.0).plan
        net = lessmem.compress(tiny_cnn().train(), plan)
        F.cross_entropy(net(batches(1)[0][0]), batches(1)[0][1]).backward()  # every plan runs


def test_knapsack_finds_the_smallest_choice_of_many_units_within_one_percent() -> None:
    """500 units (a LoRA-tuned 30-layer Llama has ~400): rounding each option up to the DP's steps
    must not cost more than the 1% ``smallest_map`` leaves above the least bytes."""
    from lessmem.sensitivity.knapsack import least_value_choice

    rng = random.Random(0)
    small = [rng.randint(900, 1100) for _ in range(500)]
    choice = least_value_choice([[1.0, 0.0]] * 500, [[b, 20 * b] for b in small], 1.01 * sum(small))
    assert choice == [0] * 500
