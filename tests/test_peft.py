"""lessmem on PEFT LoRA models (``peft.get_peft_model``): adapters on q / k / v / o and the gated
MLP's gate / up / down projections of a tiny random-init Llama (2 layers, width 64, 4 heads, 32
tokens; nothing downloaded). The frozen base layers keep nothing, adapters reading one input share
one code, native storage trains with stock's gradients, and saved bytes agree with a count taken
here with saved_tensors_hooks (independent of ``lessmem.measure_memory``). Skipped without peft
(the ``finetune`` extra).

``experiment=lora_quick`` (below): a tiny lm_quick run's checkpoint fine-tuned with LoRA
(``model.lora``, ``model.init_checkpoint``) on the stdlib's docstrings (``dataset.source=docstrings``):
the run starts from the checkpoint's weights, trains the adapters alone, reports val_ppl, and
compresses like any model against stock LoRA."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lessmem
from lessmem.cli.train import train_main
from lessmem.core import stored_bytes
from lessmem.experiment import compose_config, model_spec
from lessmem.experiment.data.text import stdlib_text
from lessmem.experiment.train import run

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB, WIDTH, TOKENS, BATCH, LAYERS = 128, 64, 32, 4, 2
ADAPTED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_llama() -> nn.Module:
    """A LoRA model on a Llama built from a config; LoRA's B matrices random too (PEFT starts them at
    zero, which would make every A gradient zero and the checks below trivial)."""
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=TOKENS))
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ADAPTED, init_lora_weights=False)
    return peft.get_peft_model(llama, config).train()


def token_batch() -> Tensor:
    return torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(1))


def lm_loss(out: object, ids: Tensor) -> Tensor:
    """Next-token cross-entropy of a causal LM's output (a ModelOutput with logits)."""
    logits = out.logits  # type: ignore[attr-defined]
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def adapter(layer: int, projection: str, part: str = "lora_A") -> str:
    block = "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{projection}.{part}" + ("" if part == "base_layer" else ".default")


def saved_by_module(model: nn.Module, ids: Tensor, **inputs: Tensor) -> dict[str, int]:
    """Independent count: each storage autograd saves in one forward (``model(ids, **inputs)``), whole
    and once, under the innermost module running when it was first saved; parameters, buffers and the
    batch excluded."""
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), ids]}
    stack, seen, kept = [""], set(), []
    counts: dict[str, int] = {}

    def pack(t: Tensor) -> Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in held and ptr != 0 and ptr not in seen:
            seen.add(ptr)
            counts[stack[-1]] = counts.get(stack[-1], 0) + t.untyped_storage().nbytes()
            kept.append(t.detach())  # no address is reused while counting
        return t.detach()  # no backward follows: a kept grad_fn would leak the graph

    def leave(module: nn.Module, args: object, out: object) -> None:
        stack.pop()  # a hook's non-None return would replace the output

    handles = [h for name, m in model.named_modules()
               for h in (m.register_forward_pre_hook(lambda mod, args, n=name: stack.append(n)), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids, **inputs)
        del out
    finally:
        for h in handles:
            h.remove()
    return counts


def trainable_grads(model: nn.Module, ids: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(ids), ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mapping", [{"*": "int8"}, {"*": 2}], ids=["int8", "pool2"])
def test_frozen_base_layers_keep_nothing(mapping: dict[str, object]) -> None:
    """``"*"`` reaches the frozen base projections and the frozen head too: they are swapped but keep
    nothing (their input gradient needs only their weight), as stock's keep nothing; the adapters'
    A matrices keep their inputs' codes."""
    model, ids = lora_llama(), token_batch()
    compressed = lessmem.compress(copy.deepcopy(model), mapping)
    frozen = [adapter(i, p, "base_layer") for i in range(LAYERS) for p in ADAPTED] + ["base_model.model.lm_head"]
    assert set(frozen) <= set(lessmem.compressed_layers(compressed))
    for counts in (saved_by_module(model, ids), saved_by_module(compressed, ids)):
        assert not any(counts.get(name) for name in frozen)
    assert all(saved_by_module(compressed, ids)[adapter(i, "q_proj")] > 0 for i in range(LAYERS))


def test_adapters_reading_one_input_share_one_code() -> None:
    """q / k / v's A matrices read the normed hidden states (and so do the frozen base projections),
    gate / up's the post-attention norm's output: one int8 code each, kept by the first reader. In
    layer 0 that input needs no gradient (frozen embedding and norm) and is kept all the same."""
    model, ids = lora_llama(), token_batch()
    counts = saved_by_module(lessmem.compress(model, {"*lora_A*": "int8"}), ids)
    code = stored_bytes(BATCH * TOKENS * WIDTH, "int8", 4)
    for layer in range(LAYERS):
        assert counts[adapter(layer, "q_proj")] == counts[adapter(layer, "gate_proj")] == code
        for sharer in ("k_proj", "v_proj", "up_proj"):
            assert adapter(layer, sharer) not in counts


@pytest.mark.parametrize("mapping, saved_storage", [(None, "native"), ({"*": 1}, "native"), ({"*": "native"}, "native"),
                                                    ({"*": 1}, {"*self_attn": "native"})],
                         ids=["companions", "kernel1", "native", "native_saved_storage"])
def test_native_storage_trains_with_stock_gradients(mapping: dict[str, object] | None,
                                                    saved_storage: str | dict[str, str]) -> None:
    """Exact companions on (Llama's gated MLP recomputed in backward, its projections LoRA layers) and
    native storage everywhere: the loss and every trainable parameter's gradient equal stock's."""
    model, ids = lora_llama(), token_batch()
    stock_loss, stock = trainable_grads(model, ids)
    compressed = lessmem.compress(copy.deepcopy(model), mapping, saved_storage=saved_storage)
    assert type(compressed.get_submodule("base_model.model.model.layers.0.mlp")).__name__ == "RecomputedGatedMLP"
    loss, grads = trainable_grads(compressed, ids)
    assert torch.equal(loss, stock_loss)
    assert grads.keys() == stock.keys() and len(grads) == 4 * len(ADAPTED)
    for name, grad in grads.items():
        assert torch.equal(grad, stock[name]), name


def test_pooled_b_inputs_leave_a_gradients_exact() -> None:
    """Pooling only the B matrices' inputs changes only their weight gradients: the gradient reaching
    every A matrix (error propagation) stays stock's, bit for bit."""
    model, ids = lora_llama(), token_batch()
    _, stock = trainable_grads(model, ids)
    _, pooled = trainable_grads(lessmem.compress(copy.deepcopy(model), {"*lora_B*": 2}), ids)
    for name, grad in pooled.items():
        assert torch.equal(grad, stock[name]) == (".lora_A." in name), name


@pytest.mark.parametrize("mapping, settings", [
    (None, {}), ({"*": 2}, {}), ({"*": "int8"}, {}),
    ({"*": "int8"}, {"act_storage": "int8", "saved_storage": "int8"}),
], ids=["companions", "pool2", "int8", "int8_everywhere"])
def test_saved_bytes_equal_an_independent_count(mapping: dict[str, object] | None, settings: dict[str, str]) -> None:
    model, ids = lora_llama(), token_batch()
    stock = lessmem.measure_memory(model, ids).total_bytes
    assert stock == sum(saved_by_module(model, ids).values())
    compressed = lessmem.compress(copy.deepcopy(model), mapping, **settings)
    report = lessmem.measure_memory(compressed, ids)
    assert report.total_bytes == sum(saved_by_module(compressed, ids).values()) < stock
    coverage = lessmem.coverage(compressed, ids)
    assert coverage.total_bytes == report.total_bytes and coverage.stock_bytes == stock
    print(f"LoRA Llama, batch {BATCH}x{TOKENS}: stock {stock} bytes, {mapping} {settings} {report.total_bytes} "
          f"({report.ratio_to(lessmem.measure_memory(model, ids)):.3f})")


def test_menu_offers_loras_own_saved_tensors() -> None:
    """The menu's token-linear items are the adapters' A and B matrices (the frozen projections and head
    have no weight gradient to approximate; o_proj's A reads the attention output, which SDPA keeps
    anyway), readers of one input choosing together, each A's exact option costing its input's bytes
    (layer 0's too, whose input needs no gradient); a map it makes saves what it predicts."""
    model, ids = lora_llama(), token_batch()
    menu = lessmem.measure_menu(model, [(ids, ids)], lessmem.MenuOptions(), lm_loss)
    items = {i.name: i for i in menu.items if i.kind == "linear"}
    expected = {adapter(i, p, part) for i in range(LAYERS) for p in ADAPTED for part in ("lora_A", "lora_B")}
    assert set(items) == expected - {adapter(i, "o_proj") for i in range(LAYERS)}
    assert menu.stock_bytes == lessmem.measure_memory(model, ids).total_bytes
    for layer in range(LAYERS):
        q, k, v, gate, up = (items[adapter(layer, p)] for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
        assert q.group == k.group == v.group != gate.group == up.group
        for item in (q, gate):
            assert item.nbytes[item.index("1")] == BATCH * TOKENS * WIDTH * 4
            assert item.nbytes[item.index("int8")] == stored_bytes(BATCH * TOKENS * WIDTH, "int8", 4)
    chosen = menu.make_map(0.75)
    saved = lessmem.measure_memory(lessmem.compress(copy.deepcopy(model), chosen.plan), ids).total_bytes
    assert saved == chosen.score["bytes"] <= 0.75 * menu.stock_bytes


def test_fit_plans_a_lora_model_for_a_budget() -> None:
    """``lessmem.fit`` on the LoRA model with AdamW on the adapters: a budget between stock's
    whole-step peak and the menu's smallest gives a plan whose measured step fits, and stock's
    frozen weights stay frozen."""
    model, ids = lora_llama(), token_batch()

    def adamw(params):
        return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3)

    stock = lessmem.fit(model, (ids, ids), 2**40, optimizer=adamw, loss_fn=lm_loss)
    budget = int(0.95 * stock.stock_step_peak_bytes)
    fitted = lessmem.fit(model, (ids, ids), budget, optimizer=adamw, loss_fn=lm_loss)
    assert stock.stock and not fitted.stock
    assert fitted.step_peak_bytes <= budget < fitted.stock_step_peak_bytes
    lessmem.compress(model, fitted.plan)
    assert any(".lora_" in name for name in lessmem.compressed_layers(model))
    print(f"lessmem.fit on the LoRA Llama: budget {budget}, stock step peak {fitted.stock_step_peak_bytes}, "
          f"chosen plan's step peak {fitted.step_peak_bytes}")


BASE_PREFIX = "base_model.model."  # what peft.get_peft_model puts before every module name


def hf_loss_step(model: nn.Module, ids: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor], int]:
    """The model's own loss on ``ids``, its trainable gradients and the bytes its graph saves
    (``saved_by_module``'s count, summed)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved_by_module(model, ids, labels=labels).values())


def test_chunked_loss_is_hfs_loss_keeping_only_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """``use_chunked_loss``: the model's own loss and LoRA gradients as HF's, ignored labels
    included, with chunks of 5 rows; the loss keeps less than HF's float32 log-probabilities."""
    from lessmem.core.ops import cross_entropy
    from lessmem.integrations.hf import use_chunked_loss

    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 5 * 4 * VOCAB)
    ids = token_batch()
    labels = ids.clone()
    labels[:, :3] = -100
    model = lora_llama()
    loss, grads, stock_bytes = hf_loss_step(model, ids, labels)
    chunked_loss, chunked_grads, chunked_bytes = hf_loss_step(use_chunked_loss(model), ids, labels)
    torch.testing.assert_close(chunked_loss, loss)
    assert grads.keys() == chunked_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, msg=name)
    assert chunked_bytes <= stock_bytes + 4 * BATCH * TOKENS + 4  # the logits for HF's log-softmax, a float a row


def test_chunked_loss_lowers_the_whole_step_peak_by_a_copy_of_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 model whose logits outweigh its layers (vocabulary 4096, width 64): HF's loss backward
    holds three float32 tensors of the logits' size at once (its log-softmax and two gradients), the
    chunked loss two bfloat16 ones (the logits and their gradient)."""
    from lessmem.core.ops import cross_entropy
    from lessmem.integrations.hf import model_loss, use_chunked_loss
    from lessmem.integrations.schedule import BatchCall, output_is_loss

    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 16 * 4 * 4096)  # 1/8 of the rows a chunk, as at long contexts
    ids = token_batch()

    def peak(chunked: bool) -> int:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=4096, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=TOKENS)).bfloat16().train()
        call = BatchCall(use_chunked_loss(model) if chunked else model, ((), {"input_ids": ids, "labels": ids}), model_loss)
        return lessmem.measure_step_memory(call, (ids, ids), loss_fn=output_is_loss, live=False).peak_bytes

    assert peak(False) - peak(True) >= BATCH * TOKENS * 4096 * 4


def test_chunked_cross_entropy_sums_over_the_trainers_count_and_rejects_bad_shapes() -> None:
    logits = torch.randn(12, 7, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(7, (12,))
    lessmem.chunked_cross_entropy(logits, targets, divisor=5).backward()
    reference = logits.detach().float().requires_grad_()
    (F.cross_entropy(reference, targets, reduction="sum") / 5).backward()
    torch.testing.assert_close(logits.grad, reference.grad.bfloat16())
    with pytest.raises(ValueError, match="logits \\(rows, classes\\)"):
        lessmem.chunked_cross_entropy(logits[None], targets)
    with pytest.raises(ValueError, match="no HF transformers model"):
        from lessmem.integrations.hf import use_chunked_loss
        use_chunked_loss(nn.Linear(2, 2))


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
