"""Memory budgets in bytes of the whole step: budget strings, a budget that holds, nothing fits,
stock fits (library and lessmem-train)."""

from __future__ import annotations

import copy
import importlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lessmem
from lessmem.cli.train import train_main
from lessmem.core import CompressionPlan
from lessmem.experiment import run
from lessmem.models import build_model
from lessmem.sensitivity import NoFit, budget_profile, format_bytes, parse_bytes, plan_batches
from lessmem.sensitivity.exact_fit import exact_ladder
from lessmem.sensitivity.fit import _Stepper, menu_samples


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.fixture(autouse=True)
def budget_cache(monkeypatch, tmp_path: Path) -> None:
    """Each test its own (empty) measurement cache."""
    monkeypatch.setenv("LESSMEM_CACHE", str(tmp_path))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = build_model("resnet20", 10).train()
    batch = (torch.randn(16, 3, 32, 32), torch.randint(10, (16,)))
    stock = lessmem.measure_step_memory(copy.deepcopy(model), batch, optimizer=sgd(model.parameters())).peak_bytes
    return model, batch, stock


@pytest.fixture(scope="module")
def profiled(setup, tmp_path_factory: pytest.TempPathFactory):
    """resnet20's budget profile, measured once on an empty cache: (the profile, its cache file)."""
    model, batch, _ = setup
    cache = tmp_path_factory.mktemp("profiled")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LESSMEM_CACHE", str(cache))
        profile = budget_profile(model, batch, optimizer=sgd)
    (path,) = (cache / "budget").glob("*.json")
    return profile, path


@pytest.fixture
def warm(profiled, tmp_path: Path) -> None:
    """This test's cache holds resnet20's profile, as a second budget on the same setup finds it."""
    (tmp_path / "budget").mkdir()
    shutil.copy(profiled[1], tmp_path / "budget")


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the commands run on the ``tiny`` config: the second finds the first's profile."""
    return tmp_path_factory.mktemp("tiny_cache")


@pytest.mark.parametrize(("text", "nbytes"), [("6GiB", 6 * 2**30), ("750MiB", 750 * 2**20), ("1.5gib", 3 * 2**29),
                                              ("2GB", 2 * 10**9), ("123456", 123456), (4096, 4096)])
def test_budget_strings(text: str | int, nbytes: int) -> None:
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["6 parsecs", "GiB", "-1MiB", "0", "", "6GiB and more"])
def test_bad_budget_string_is_one_line(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_bytes(text)
    assert "\n" not in str(e.value) and (repr(text) in str(e.value))


def test_label_round_trips() -> None:
    assert format_bytes(parse_bytes("6GiB")) == "6GiB" and format_bytes(parse_bytes("750MiB")) == "750MiB"


def test_budget_holds(setup, warm, tmp_path: Path) -> None:
    model, batch, stock = setup
    budget = int(0.6 * stock)
    choice = lessmem.fit(model, batch, budget, optimizer=sgd)
    assert not choice.stock and choice.plan.map and choice.step_peak_bytes <= budget
    net = lessmem.compress(copy.deepcopy(model), choice.plan)
    assert lessmem.measure_step_memory(net, batch, optimizer=sgd(net.parameters())).peak_bytes <= budget
    # From the cache: the menu and the measured points of the first search (a map may change with them).
    again = lessmem.fit(model, batch, budget, optimizer=sgd)
    assert again.step_peak_bytes <= budget and len(list((tmp_path / "budget").glob("*.json"))) == 1


@pytest.mark.slow
def test_a_cache_from_before_a_criterion_is_measured_again(setup, warm, tmp_path: Path) -> None:
    """A cache written before a criterion existed is measured again, not a failed choice."""
    model, batch, stock = setup
    budget = int(0.6 * stock)
    (cached,) = (tmp_path / "budget").glob("*.json")
    older = json.loads(cached.read_text())
    for item in older["menu"]["items"]:
        del item["criteria"]["tensor_error"]
    cached.write_text(json.dumps(older))
    assert lessmem.fit(model, batch, budget, optimizer=sgd).step_peak_bytes <= budget
    assert all("tensor_error" in i["criteria"] for i in json.loads(cached.read_text())["menu"]["items"])


def test_cache_key_tells_models_apart_by_their_layers_settings(setup) -> None:
    """Two models with the same parameters whose peaks differ (a stride, an in-place ReLU) are
    measured apart: the cache key holds each module's settings, not only its type."""
    model, batch, _ = setup
    strided, copying = copy.deepcopy(model), copy.deepcopy(model)
    strided.conv1.stride = (2, 2)
    copying.relu.inplace = False
    keys = {_Stepper(m, batch, sgd, F.cross_entropy, None).key() for m in (model, strided, copying)}
    assert len(keys) == 3


def test_profile_interpolates_between_measured_maps(setup, profiled) -> None:
    model, batch, stock = setup
    profile, _ = profiled
    assert profile.menu is not None and profile.floor_peak is not None
    assert profile.menu.meta["measured_batch"] == menu_samples(len(batch[0])) < len(batch[0])
    # stock, the floor and a map near the bend between them: budgets are interpolated, not extrapolated
    (floor_saved, floor_peak), (mid_saved, mid_peak), (stock_saved, stock_peak) = profile.peaks.points
    assert floor_saved < mid_saved < stock_saved and floor_peak <= mid_peak < stock_peak == stock
    assert profile.peaks.predict(mid_saved) == mid_peak


def test_plan_batches_fit_the_budget(profiled) -> None:
    profile, _ = profiled
    assert profile.floor_peak is not None
    budget = (profile.stock_peak + profile.floor_peak) / 2
    rows = plan_batches(profile, budget)
    sizes = [r.batch_size for r in rows]
    assert sizes == sorted(set(sizes)) and rows[0].fits and not rows[-1].fits
    assert all(r.predicted_peak_bytes <= budget for r in rows if r.fits)


def test_nothing_fits(setup, warm) -> None:
    model, batch, _ = setup
    with pytest.raises(NoFit, match=r"smallest whole-step peak the menu reaches is .*largest batch that fits"):
        lessmem.fit(model, batch, "1KiB", optimizer=sgd)


def test_stock_fits(setup, tmp_path: Path) -> None:
    model, batch, stock = setup
    choice = lessmem.fit(model, batch, stock, optimizer=sgd)
    assert choice.stock and choice.plan.map == {} and choice.step_peak_bytes == stock
    assert not lessmem.compressed_layers(lessmem.compress(copy.deepcopy(model), choice.plan))


def test_train_nothing_fits_is_one_line(run_cli, tiny, tiny_cache: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LESSMEM_CACHE", str(tiny_cache))
    result = run_cli(train_main, "lessmem-train", *tiny, f"out_dir={tmp_path}", "memory_budget=1KiB")
    assert result.is_one_error("lessmem-train", "largest batch that fits")


def test_train_bad_budget_fails_before_reading_data(run_cli, tiny, tmp_path: Path) -> None:
    # The dataset root does not exist either: the budget is checked first, before any data is read.
    on_disk = [o for o in tiny if not o.startswith("dataset")] + ["dataset=cifar10", f"dataset.root={tmp_path / 'no'}"]
    result = run_cli(train_main, "lessmem-train", *on_disk, f"out_dir={tmp_path}", "memory_budget=6QB")
    assert result.is_one_error("lessmem-train", "memory size '6QB' is not bytes")


def test_train_stock_fits_records_budget(compose, tiny, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        metrics = run(compose(*tiny, f"out_dir={tmp_path}", "memory_budget=10GiB"))  # tiny is compression=pool2
    assert "memory_budget=10GiB replaces compression 'pool2'" in caplog.text
    memory = json.loads((tmp_path / "memory.json").read_text())
    for record in (metrics, memory):
        assert record["memory_budget_bytes"] == 10 * 2**30 and record["budget_stock_fits"]
        assert record["compression"] == "budget_10GiB" and record["step_peak_bytes"] <= 10 * 2**30


def test_a_resumed_budget_run_keeps_its_map_and_refuses_another_budget(compose, tiny, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming a ``memory_budget`` run trains the map its checkpoint kept: ``lessmem.fit`` is not asked
    again (its cache grows with every fit, and a fit on more points may choose another map); another
    budget is refused by name."""
    first = run(compose(*tiny, f"out_dir={tmp_path}", "memory_budget=10GiB"))

    def fit_again(*args, **kwargs):
        raise AssertionError("a resumed budget run fitted its map again")

    monkeypatch.setattr("lessmem.experiment.budget.fit", fit_again)
    again = run(compose(*tiny, f"out_dir={tmp_path}", "memory_budget=10GiB", "epochs=2", "resume=true"))
    kept = ("compression", "compression_hash", "memory_budget_bytes", "budget_stock_fits", "budget_step_peak_bytes")
    assert len(again["history"]) == 2 and {k: again[k] for k in kept} == {k: first[k] for k in kept}
    with pytest.raises(ValueError, match=r"resume: memory_budget differs from the checkpoint's \(10GiB vs 9GiB\)"):
        run(compose(*tiny, f"out_dir={tmp_path}", "memory_budget=9GiB", "epochs=3", "resume=true"))


def test_plan_cli_writes_rows_table_and_plot(run_cli, tiny, tiny_cache: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from lessmem.cli.plan import main

    monkeypatch.setenv("LESSMEM_CACHE", str(tiny_cache))
    out, cwd = tmp_path / "plan", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    result = run_cli(main, "lessmem-plan", *tiny, f"hydra.run.dir={out}", "memory_budget=64MiB", "plan.factors=[1,2,8]")
    assert result.status == 0, result.stderr
    assert not list(cwd.iterdir())  # everything in Hydra's run dir, as test_cli.py checks for the others
    assert {".hydra", "plan.log", "plan.csv", "plan.json", "plan.png"} <= {p.name for p in out.iterdir()}
    plan = json.loads((out / "plan.json").read_text())
    rows = plan["rows"]
    assert plan["memory_budget_bytes"] == 64 * 2**20 and len(rows) == 3
    assert [r["batch_size"] for r in rows] == sorted(r["batch_size"] for r in rows)
    assert rows[0]["fits"] and rows[0]["predicted_peak_bytes"] <= 64 * 2**20
    for r in rows:  # a fitting row's best map is predicted within the budget; else the floor is over it
        assert (r["predicted_peak_bytes"] <= 64 * 2**20) == r["fits"]
        assert (r["grad_error"] is None) != r["fits"]
    assert result.stdout.count("\n| ") == 1 + 3 and (out / "plan.png").stat().st_size > 0
    assert len((out / "plan.csv").read_text().splitlines()) == 1 + 3
    missing = run_cli(main, "lessmem-plan", *tiny, f"out_dir={tmp_path / 'none'}")
    assert missing.is_one_error("lessmem-plan", "needs memory_budget")


def test_exact_fit_keeps_stock_gradients_within_the_budget(setup) -> None:
    """fidelity="exact": a plan of exact options only (recomputed blocks among them) whose measured
    peak fits; compressed with it, the model's gradients are stock's to float rounding."""
    model, batch, stock = setup
    fitted = lessmem.fit(model, batch, int(0.75 * stock), optimizer=sgd, fidelity="exact")
    assert fitted.fidelity == "exact" and fitted.plan.lossless and fitted.plan.recompute
    assert fitted.step_peak_bytes <= 0.75 * stock and fitted.floor_step_peak_bytes <= fitted.step_peak_bytes
    assert fitted.step_time_ratio > 0 and fitted.record()["budget_fidelity"] == "exact"
    grads = []
    for net in (copy.deepcopy(model), lessmem.compress(copy.deepcopy(model), fitted.plan)):
        torch.manual_seed(0)
        torch.nn.functional.cross_entropy(net(batch[0]), batch[1]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    assert torch.allclose(grads[1], grads[0], rtol=1e-5, atol=1e-5 * grads[0].abs().max().item())


@pytest.mark.parametrize("bare_is_lower", [False, True])
def test_exact_ladder_runs_on_the_ladder_with_the_lower_floor(setup, bare_is_lower: bool) -> None:
    """fit's exact search and benchmarks/context.py take one ladder: lessmem's (companions, from_bn,
    chunked BatchNorm, regions) or, where its floor peaks lower, plain checkpointing's (regions alone)."""
    model, batch, _ = setup
    measured = []

    def peak(plan) -> int:  # a stand-in for the measured step: plain checkpointing keeps no companions
        measured.append(plan)
        return 10 if (not plan.exact_companions) is bare_is_lower else 20

    ladder = exact_ladder(model, batch[0][:4], 4.0, peak)
    assert ladder.bare is bare_is_lower and ladder.floor_peak == 10 and len(measured) == 2
    assert ladder.plans[-1].recompute == tuple(c.name for c in ladder.costs) and ladder.costs
    assert all(not plan.exact_companions for plan in ladder.plans) is bare_is_lower


def test_exact_fit_below_the_floor_and_bad_fidelity(setup) -> None:
    model, batch, stock = setup
    with pytest.raises(NoFit, match=r"no exact plan fits .*exact floor .* peaks at .*(largest batch|not even one)"):
        lessmem.fit(model, batch, int(0.2 * stock), optimizer=sgd, fidelity="exact")
    with pytest.raises(ValueError, match="fidelity 'precise': choose one of exact, lossy, auto"):
        lessmem.fit(model, batch, stock, optimizer=sgd, fidelity="precise")


def test_train_bad_fidelity_is_one_line(run_cli, tiny, tmp_path: Path) -> None:
    result = run_cli(train_main, "lessmem-train", *tiny, f"out_dir={tmp_path}", "memory_budget=64MiB", "fidelity=precise")
    assert result.is_one_error("lessmem-train", "fidelity=precise: choose one of exact, lossy, auto")


def test_auto_fidelity_takes_the_lossy_plan_past_the_step_ratio(setup, warm) -> None:
    """fidelity="auto": exact while its measured step is within max_step_ratio of stock's, else lossy."""
    model, batch, stock = setup
    fitted = lessmem.fit(model, batch, int(0.75 * stock), optimizer=sgd, fidelity="auto", max_step_ratio=0.0)
    assert fitted.fidelity == "lossy" and fitted.step_peak_bytes <= 0.75 * stock



def test_a_step_ratio_near_its_limit_is_timed_on_more_steps(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three alternating steps decide a ratio far from the limit; near it (within NEAR_LIMIT) six more of
    each join them, so that one noisy step does not flip the choice."""
    model, batch, _ = setup
    calls: list[int] = []

    def times(steps, repeats, **kwargs):
        calls.append(repeats)
        planned = [1.24, 1.26, 1.24] if len(calls) == 1 else [1.40] * repeats  # slower once timed longer
        return [[1.0] * repeats, planned]

    # the module, not the function lessmem.sensitivity re-exports under the same name
    monkeypatch.setattr(importlib.import_module("lessmem.sensitivity.fit"), "alternating_step_times", times)
    stepper, plan = _Stepper(model, batch, sgd, F.cross_entropy, None), CompressionPlan()
    assert stepper.time_ratio(plan, limit=2.0) == pytest.approx(1.24) and calls == [3]
    calls.clear()
    assert stepper.time_ratio(plan) == pytest.approx(1.24) and calls == [3]
    calls.clear()
    assert stepper.time_ratio(plan, limit=1.25) == pytest.approx(1.40) and calls == [3, 6]


def _tiny_lm(hidden: int, intermediate: int, seq: int, batch: int) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    model = build_model("tiny_llama", num_classes=64, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4).train()
    data = (torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq)))
    return model, data, {"optimizer": sgd, "loss_fn": lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())}


def test_lossy_fit_recomputes_layers_within_the_measured_step_ratio(monkeypatch, caplog) -> None:
    """fidelity=lossy, max_step_ratio > 1: decoder layers recomputed (int8 codes inside their rerun)
    where that lowers the error; the chosen map's step is measured; a step over max_step_ratio makes
    the search choose again with fewer reruns (here: codes only); max_step_ratio=1: codes only."""
    model, batch, settings = _tiny_lm(32, 64, 128, 8)
    budget = int(1.2 * budget_profile(model, batch, **settings).floor_peak)
    codes = lessmem.fit(model, batch, budget, max_step_ratio=1.0, **settings)
    fitted = lessmem.fit(model, batch, budget, max_step_ratio=10.0, **settings)
    assert not codes.plan.recompute and codes.step_time_ratio is None
    assert fitted.plan.recompute and fitted.step_peak_bytes <= budget
    assert fitted.score["tensor_error"] < 0.1 * codes.score["tensor_error"]
    assert fitted.step_time_ratio is not None and fitted.record()["budget_step_time_ratio"] == fitted.step_time_ratio
    monkeypatch.setattr(_Stepper, "time_ratio", lambda self, plan, repeats=3, limit=None: 20.0)
    with caplog.at_level(logging.INFO, logger="lessmem.sensitivity.fit"):
        slow = lessmem.fit(model, batch, budget, max_step_ratio=1.5, **settings)
    assert "the map's step takes 20.00x stock's" in caplog.text and "reruns within" in caplog.text
    assert not slow.plan.recompute and slow.step_time_ratio is None and slow.step_peak_bytes <= budget


@pytest.mark.slow
def test_recomputed_layers_reach_below_the_codes_floor(monkeypatch, caplog) -> None:
    """Below every codes-only map's peak, recomputed layers fit; where a shorter rerun allowance
    then fits nothing, the slower map stays, said in a warning."""
    model, batch, settings = _tiny_lm(64, 128, 256, 16)
    profile = budget_profile(model, batch, **settings)
    budget = int(0.97 * profile.floor_peak)
    with pytest.raises(NoFit, match="no map fits"):
        lessmem.fit(model, batch, budget, max_step_ratio=1.0, **settings)
    fitted = lessmem.fit(model, batch, budget, max_step_ratio=10.0, **settings)
    assert fitted.plan.recompute and fitted.step_peak_bytes <= budget and fitted.floor_step_peak_bytes <= budget
    monkeypatch.setattr(_Stepper, "time_ratio", lambda self, plan, repeats=3, limit=None: 20.0)
    with caplog.at_level(logging.INFO, logger="lessmem.sensitivity.fit"):
        slow = lessmem.fit(model, batch, budget, max_step_ratio=10.0, **settings)
    assert "keeping the map whose step takes 20.00x" in caplog.text
    assert slow.plan.recompute and slow.step_time_ratio == 20.0 and slow.step_peak_bytes <= budget
