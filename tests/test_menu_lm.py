"""The menu of a language model and the menu's 1-bit end: token linears, GELU / SiLU inputs and
saved-tensor regions (norm inputs, attention's saved tensors, gated products) as items, bytes
predicted exactly as measure_memory counts them; 1-bit BatchNorm inputs; the CLI measuring on
warmed-up weights."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_sensitivity import batches, tiny_cnn

import lessmem
from lessmem.experiment import compose_config, fixed_batches, run, task_of
from lessmem.models import build_model
from lessmem.sensitivity import MenuOptions, MenuResult, measure_menu

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
    batch = fixed_batches(cfg, 1, 4)[0]
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
