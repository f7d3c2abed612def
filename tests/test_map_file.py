"""A map file is a complete choice: it never runs without the exact companions unless asked, its
name labels the run, and the record carries the map and its hash (issue 23)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lessmem.cli.train import train_main
from lessmem.experiment import run
from lessmem.experiment.compression import resolve_compression


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
