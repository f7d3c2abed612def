"""``compress(..., saved_storage=...)``: lossy storage for the tensors saved inside chosen modules,
on tiny random-init HF Llama and GPT-2 language models (2 layers, width 64, 32 tokens)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lessmem
from lessmem.core.ops.dispatch import ORIGINAL_CLASS_ATTR
from lessmem.core.saved_storage import HOOK_IDS_ATTR

transformers = pytest.importorskip("transformers")

TOKENS, WIDTH, VOCAB = 32, 64, 1000


def hf_llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=3 * WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS))


def hf_gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=4, n_positions=TOKENS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


MODELS = {"hf_llama": hf_llama, "hf_gpt2": hf_gpt2}


def build(name: str) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    model = MODELS[name]().train()
    return model, torch.randint(0, VOCAB, (2, TOKENS))


def loss_and_grads(model: nn.Module, ids: Tensor) -> tuple[Tensor, Tensor]:
    """The language-model loss and every parameter gradient, concatenated."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def storage_bytes(model: nn.Module, ids: Tensor) -> int:
    """Independent count: whole storages autograd saves (each once), parameters, buffers and the
    input excluded."""
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), ids]}
    storages: dict[int, int] = {}
    kept: list[Tensor] = []  # no address is reused while counting

    def pack(t: Tensor) -> Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in held and ptr != 0:
            storages[ptr] = t.untyped_storage().nbytes()
            kept.append(t.detach())
        return t.detach()  # no backward follows: a kept grad_fn would leak the graph

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids)
    del out
    return sum(storages.values())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("rule", ["native", {"*attn": "native", "*": "native"}])
def test_native_changes_nothing(name: str, rule: str | dict[str, str]) -> None:
    model, ids = build(name)
    stock = loss_and_grads(model, ids)
    native = lessmem.compress(copy.deepcopy(model), None, saved_storage=rule)
    assert not any(HOOK_IDS_ATTR in m.__dict__ for m in native.modules())
    loss, grads = loss_and_grads(native, ids)
    assert torch.equal(loss, stock[0])
    assert torch.equal(grads, stock[1])


# storage -> least cosine of the whole parameter gradient to stock (measured: bf16 and int8 >= 0.9999)
LOSSY = {"bf16": 0.999, "int8": 0.99}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("storage", LOSSY)
def test_lossy_storage_keeps_forward_and_gradient_direction(name: str, storage: str) -> None:
    """The forward is exact; the gradient is that of decoded saved tensors: close in direction."""
    model, ids = build(name)
    stock_loss, stock_grads = loss_and_grads(model, ids)
    lossy = lessmem.compress(copy.deepcopy(model), None, saved_storage=storage)
    loss, grads = loss_and_grads(lossy, ids)
    assert torch.equal(loss, stock_loss)
    assert not torch.equal(grads, stock_grads)
    assert F.cosine_similarity(grads, stock_grads, dim=0) >= LOSSY[storage]


@pytest.mark.parametrize("name", MODELS)
def test_saved_bytes_drop_and_are_counted_as_packed(name: str) -> None:
    """int8 keeps about a quarter of fp32; measure_memory counts the packed parts, matching an
    independent count of whole storages taken with its own hooks outside the model."""
    model, ids = build(name)
    stock = lessmem.measure_memory(model, ids).total_bytes
    lossy = lessmem.compress(copy.deepcopy(model), None, saved_storage="int8")
    counted = lessmem.measure_memory(lossy, ids).total_bytes
    assert counted < 0.5 * stock
    assert counted == storage_bytes(lossy, ids)


@pytest.mark.parametrize("name", MODELS)
def test_uncompress_restores_stock(name: str) -> None:
    model, ids = build(name)
    stock = loss_and_grads(model, ids)
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    lessmem.compress(model, {"*": 2}, saved_storage={"*.mlp*": "int8", "*": "bf16"})
    blocks = "model.layers" if name == "hf_llama" else "transformer.h"
    hooked = {n for n, m in model.named_modules() if HOOK_IDS_ATTR in m.__dict__}
    swapped = {n for n, m in model.named_modules() if ORIGINAL_CLASS_ATTR in m.__dict__}
    # where the rule changes, and lessmem's layers (what they store is left alone)
    assert hooked == {"", f"{blocks}.0.mlp", f"{blocks}.1.mlp"} | swapped
    lessmem.uncompress(copy.deepcopy(model))  # a copy's hooks are its own: the original keeps its hooks
    assert HOOK_IDS_ATTR in model.__dict__
    lessmem.uncompress(model)
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks
    loss, grads = loss_and_grads(model, ids)
    assert torch.equal(loss, stock[0])
    assert torch.equal(grads, stock[1])


def test_innermost_rule_wins_and_lessmem_layers_are_left_alone() -> None:
    """Attention and its projections stay exact inside an int8 model ("*.self_attn*" reaches the
    projections too; "*" would match them first); the pooled projections keep their own storage."""
    model, ids = build("hf_llama")
    lessmem.compress(model, {"*": 2}, saved_storage={"*.self_attn*": "native", "*": "int8"})
    rows = lessmem.coverage(model, ids, compare_stock=False).rows
    packed = {r.layer for r in rows if r.op == "saved_storage"}
    assert packed and not any(".self_attn" in layer for layer in packed)
    assert {"model.layers.0.input_layernorm", "model.layers.0.mlp"} <= packed
    assert all(r.how == "int8 (approximate)" for r in rows if r.op == "saved_storage")
    pooled = [r for r in rows if r.op.startswith("PooledLinearFunctionBackward")]
    assert pooled and all(r.dtype == "float32" for r in pooled)
    assert any(r.op.startswith("ScaledDotProduct") and not r.compressed for r in rows)


def test_parameters_and_inputs_are_left_alone() -> None:
    """A linear's weight (saved as a transposed view, for the input gradient) and an input batch
    (saved for the weight gradient) are held anyway: not packed, so every gradient stays exact."""
    torch.manual_seed(0)
    model = nn.Linear(WIDTH, 2 * WIDTH)  # 8192 weights: large enough to be packed if it were not held
    small = torch.randn(8, WIDTH, requires_grad=True)  # 512 elements: too small to be packed
    batch = torch.randn(4 * TOKENS, WIDTH)  # 8192 elements, no autograd history
    grads = []
    for m in (model, lessmem.compress(copy.deepcopy(model), None, saved_storage="int8")):
        small.grad = None
        (m(small * 2).square().sum() + m(batch).square().sum()).backward()
        grads.append(torch.cat([small.grad.flatten(), *(p.grad.flatten() for p in m.parameters())]))
    assert torch.equal(grads[0], grads[1])


def test_checkpointing_sees_the_packed_tensors() -> None:
    """Modules inside a checkpointed block (HF checkpoints each decoder layer inside its hooks:
    its children are inside) hand their packed parts to checkpoint's hooks, and the recomputed
    forward packs the same way: the gradients equal an uncheckpointed lossy run's (rounded to
    nearest: the recomputed forward draws noise of its own)."""
    model, ids = build("hf_llama")
    lessmem.compress(model, None, saved_storage={"model.layers.*.*": "int8_rn"})
    plain = loss_and_grads(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, grads = loss_and_grads(model, ids)
    assert torch.equal(loss, plain[0])
    assert torch.equal(grads, plain[1])


@pytest.mark.parametrize("rule, message", [
    ({"*attention": "int8"}, "saved_storage pattern '\\*attention' matches no module name; have 'model'"),
    ("int3", "unknown storage 'int3'"),
])
def test_bad_rule_is_an_error(rule: str | dict[str, str], message: str) -> None:
    model, _ = build("hf_llama")
    with pytest.raises(ValueError, match=message):
        lessmem.compress(model, None, saved_storage=rule)
