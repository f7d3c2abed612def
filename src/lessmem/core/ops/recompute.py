"""A pure function of a few tensors that keeps only those tensors for backward: backward reruns it
under autograd, so output and gradients are bit for bit those of calling it directly, for the
memory of its inputs instead of its intermediates (a multi-op activation formula saves several
full-size tensors per call).

Its layers are exact companions for timm / HF modules whose forward is such a formula (matched by
class name in the ``registry``): they keep the formula's inputs and recompute it in backward, bit
for bit, instead of keeping each op's intermediate."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from lessmem.core.ops.dispatch import ORIGINAL_CLASS_ATTR, needs_saving
from lessmem.core.ops.linear import CompressedLinear, keeps_stock_path
from lessmem.core.ops.pooling import offer_pooled_tokens
from lessmem.core.saved_storage import HOOK_IDS_ATTR, RULE_ATTR, note_packed
from lessmem.core.storage import pack_tensor, sliceable, tensor_meta, unpack_samples, unpack_tensor


class RecomputedFunction(torch.autograd.Function):
    """``fn(*inputs)`` saving ``inputs`` only. ``fn`` must be deterministic (no dropout, no RNG)
    and must not modify its inputs."""

    @staticmethod
    def forward(ctx, fn: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
        device = inputs[0].device.type
        ctx.fn = fn
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        wanted = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(w) for t, w in zip(ctx.saved_tensors, wanted, strict=True)]
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = ctx.fn(*inputs)
        grads = iter(torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad))
        return None, *(next(grads) if t.requires_grad else None for t in inputs)


# Elements of the widest full-size tensor one row slice of the sliced gated MLP holds.
SLICE_ELEMENTS = 2**17
# A norm's slice holds fewer tensors (the decoded rows, the normalised rows and their gradient):
# twice the rows leave the tiny Llama's whole-step peak where it was (forward, attention), for half
# the slices.
NORM_SLICE_ELEMENTS = 2 * SLICE_ELEMENTS


class SlicedGatedMLPFunction(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))`` for token linears without token pooling, run a slice of
    token rows at a time, forward and backward: no full-size gate(x), up(x) or down input exists.
    Per slice, forward keeps x, gate(x), up(x) and the down input packed (``storages``: x's,
    gate / up's, the down input's); backward decodes them one slice at a time, reruns ``act``
    under autograd on it (the product's backward is two products, as autograd's), writes the
    slice's input gradient and adds the slice's weight gradients. Each output and input-gradient
    row is what the unsliced ops compute on the same (decoded) values, up to the matrix products'
    blocking; the weight gradients are sums of slice partial sums (another float summation
    order)."""

    @staticmethod
    def forward(ctx, act: Callable[[Tensor], Tensor], x: Tensor, wg: Tensor, bg: Tensor | None,
                wu: Tensor, bu: Tensor | None, wd: Tensor, bd: Tensor | None, storages: tuple[str, str, str]):
        x_storage, saved_storage, h_storage = storages
        needs = ctx.needs_input_grad
        x2 = x.reshape(-1, x.shape[-1])
        n = x2.shape[0]
        step = max(1, SLICE_ELEMENTS // max(x2.shape[1], wg.shape[0], wd.shape[0]))
        out = x2.new_empty(n, wd.shape[0])
        saved, metas = [], []
        for r0 in range(0, n, step):
            x_rows = x2[r0:r0 + step]
            gate, up = F.linear(x_rows, wg, bg), F.linear(x_rows, wu, bu)
            h = act(gate) * up
            rows = out[r0:r0 + step]  # written in place: F.linear's own ops
            if bd is None:
                torch.mm(h, wd.t(), out=rows)
            else:
                torch.addmm(bd, h, wd.t(), out=rows)
            parts = (pack_tensor(x_rows.detach(), x_storage) if needs[2] or needs[4] else (),
                     _pack_saved(gate, saved_storage), _pack_saved(up, saved_storage),
                     pack_tensor(h, h_storage) if needs[6] else ())
            saved.append(parts)
            metas.append(tuple(tensor_meta(t) for t in (x_rows, gate, up, h)))
        ctx.save_for_backward(wg, wu, wd, *(t for parts in saved for p in parts for t in p))
        ctx.counts = [[len(p) for p in parts] for parts in saved]
        ctx.metas, ctx.step, ctx.act, ctx.storages = metas, step, act, storages
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        wg, wu, wd, *flat = ctx.saved_tensors
        x_storage, saved_storage, h_storage = ctx.storages
        stores = (x_storage, saved_storage, saved_storage, h_storage)
        needs = ctx.needs_input_grad
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        dx = flat_grad.new_empty(flat_grad.shape[0], wg.shape[1]) if needs[1] else None
        gw: list[Tensor | None] = [None, None, None]  # gate, up, down
        gb: list[Tensor | None] = [None, None, None]
        start = 0
        for j, (counts, metas) in enumerate(zip(ctx.counts, ctx.metas, strict=True)):
            parts = []
            for count in counts:
                parts.append(flat[start:start + count])
                start += count

            def decoded(i: int) -> Tensor:
                return unpack_tensor(parts[i], stores[i], metas[i])  # noqa: B023 (used in this iteration)

            r0 = j * ctx.step
            g = flat_grad[r0:r0 + ctx.step]
            if needs[6]:
                gw[2] = _addmm(gw[2], g.t(), decoded(3))
            with torch.enable_grad():
                gate = decoded(1).detach().requires_grad_()
                act = ctx.act(gate)
            dh, up = g @ wd, decoded(2)
            dup = dh * act  # the product's backward, as autograd's (no rerun of the product itself)
            (dgate,) = torch.autograd.grad(act, gate, dh * up)
            del act, gate, up, dh
            if dx is not None:
                torch.mm(dgate, wg, out=dx[r0:r0 + ctx.step]).addmm_(dup, wu)
            if needs[2] or needs[4]:
                x_rows = decoded(0)
                if needs[2]:
                    gw[0] = _addmm(gw[0], dgate.t(), x_rows)
                if needs[4]:
                    gw[1] = _addmm(gw[1], dup.t(), x_rows)
            for i, d, wanted in ((0, dgate, needs[3]), (1, dup, needs[5])):
                if wanted:
                    gb[i] = _add(gb[i], d.sum(0))
        if needs[7]:
            gb[2] = flat_grad.sum(0)
        dx = dx.view(*grad_out.shape[:-1], -1) if dx is not None else None
        return None, dx, gw[0], gb[0], gw[1], gb[1], gw[2], gb[2], None


def _pack_saved(t: Tensor, storage: str) -> tuple[Tensor, ...]:
    """``t`` packed in the saved_storage rule's ``storage`` (named as that rule's for coverage)."""
    packed = pack_tensor(t, storage)
    return packed if storage == "native" else note_packed(packed, storage)


def _add(total: Tensor | None, part: Tensor) -> Tensor:
    return part if total is None else total.add_(part)


def _addmm(total: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """``total + a @ b`` into ``total`` (no temporary product), or ``a @ b`` first."""
    return a @ b if total is None else total.addmm_(a, b)


class SlicedAttentionFunction(torch.autograd.Function):
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)`` (no mask, no dropout)
    keeping q, k and v packed in ``storage`` a batch slice at a time; backward decodes one slice
    and writes that slice's gradients. No full-size decoded q / k / v is made in backward.

    Two ways to get the attention's backward on the decoded slice:

    - ``share_output`` and SDPA's CPU flash kernel: forward keeps the kernel's log-sum-exp (one
      float per query and head) and the output packed, laid out (batch, tokens, heads, dim) as the
      out-projection reads it (HF's ``transpose(1, 2).contiguous()`` is then no copy) and offered
      to that projection as its own saved input (``offer_pooled_tokens``): one code serves both.
      Backward calls the flash backward on the decoded q, k, v and output with the forward's
      log-sum-exp: no rerun. The gradients are the flash backward's at the decoded values, with
      the row normalization of the exact forward (not a gradient of any one attention: within
      the codes' error of the rerun's).
    - else the attention is rerun on the decoded slice (``_attention_grads``): the gradients are
      the attention's own at the decoded values; nothing but q, k, v is kept.

    Forward is the one attention call either way (the output's values are SDPA's)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None, storage: str,
                share_output: bool = False):
        step = max(1, SLICE_ELEMENTS // max(t[0].numel() for t in (q, k, v)))
        saved, metas = [], []
        for b0 in range(0, q.shape[0], step):
            for t in (q, k, v):
                part = t[b0:b0 + step].detach()
                saved.append(_pack_saved(part, storage))
                metas.append(tensor_meta(part))
        ctx.counts, ctx.metas, ctx.step = [len(p) for p in saved], metas, step
        ctx.is_causal, ctx.scale, ctx.storage = is_causal, scale, storage
        ctx.output_meta = None
        if share_output and _flash_on_cpu(q, k, v, is_causal, scale):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
            out = out.transpose(1, 2).contiguous()  # (B, T, H, d): the out-projection's layout
            batch, length, heads, dim = out.shape
            tokens = out.view(batch, length, heads * dim)  # as the out-projection reads it
            meta = tensor_meta(tokens)
            out = out.transpose(1, 2)
            if sliceable(meta, storage):  # else samples do not start on a code group: rerun
                packed = _pack_saved(tokens, storage)
                ctx.output_meta, ctx.output_count, ctx.heads = meta, len(packed), heads
                offer_pooled_tokens(tokens, 1, storage, (packed, meta))
                ctx.save_for_backward(lse, *packed, *(t for p in saved for t in p))
                return out
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
        ctx.save_for_backward(*(t for p in saved for t in p))
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        flat = ctx.saved_tensors
        if ctx.output_meta is not None:
            lse, packed_out, flat = flat[0], flat[1:1 + ctx.output_count], flat[1 + ctx.output_count:]
        n = grad_out.shape[0]
        grads = [grad_out.new_empty((n, *ctx.metas[i].shape[1:])) for i in range(3)]
        start = 0
        for j in range(len(ctx.metas) // 3):
            decoded = []
            for i in range(3):
                count = ctx.counts[3 * j + i]
                decoded.append(unpack_tensor(flat[start:start + count], ctx.storage, ctx.metas[3 * j + i]).detach())
                start += count
            b0, b1 = j * ctx.step, min(n, (j + 1) * ctx.step)
            if ctx.output_meta is None:
                parts = _attention_grads(*decoded, grad_out[b0:b1], ctx.is_causal, ctx.scale)
            else:
                out = unpack_samples(packed_out, ctx.storage, ctx.output_meta, b0, b1)
                out = out.view(b1 - b0, out.shape[1], ctx.heads, -1).transpose(1, 2)
                parts = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad_out[b0:b1], *decoded, out, lse[b0:b1], 0.0, ctx.is_causal, scale=ctx.scale)
                del out
            del decoded
            for g, part in zip(grads, parts, strict=True):
                g[b0:b1] = part
        return *grads, None, None, None, None


def _flash_on_cpu(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None) -> bool:
    """Whether SDPA runs its CPU flash kernel on these inputs (no mask, no dropout)."""
    return q.device.type == "cpu" and torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale) == _FLASH


def _attention_grads(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, is_causal: bool,
                     scale: float | None) -> tuple[Tensor, ...]:
    """SDPA's gradients at q, k, v for its output gradient ``grad``. Where SDPA would run its CPU
    flash kernel, that kernel and its backward are called as SDPA's autograd calls them, without
    building a graph (~0.4 ms a call saved); else SDPA reruns under autograd."""
    if _flash_on_cpu(q, k, v, is_causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, is_causal, scale=scale)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=scale)
    return torch.autograd.grad(out, leaves, grad)


_FLASH = int(SDPBackend.FLASH_ATTENTION)


class SlicedRMSNormFunction(torch.autograd.Function):
    """HF Llama's RMSNorm, ``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim, keeping
    ``x`` only, packed in ``storage`` a slice of rows at a time; backward decodes one slice and
    writes that slice's input gradient from the norm's closed form,
    r * (dh - h * mean(dh * h)) with r = rsqrt(mean(x^2) + eps), h = x * r, dh = grad * weight,
    and adds up the weight's gradient (slice partial sums). The output is the stock formula's, bit
    for bit; the gradients are the norm's at the decoded input, to float rounding (the formula's
    terms in another order than autograd's through the stock ops: ~1e-7 relative), in a third of
    the time a rerun under autograd takes."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, storage: str) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        step = max(1, NORM_SLICE_ELEMENTS // rows.shape[1])
        starts = range(0, rows.shape[0], step)
        saved = [_pack_saved(rows[r0:r0 + step].detach(), storage) for r0 in starts]
        ctx.save_for_backward(weight, *(t for p in saved for t in p))
        ctx.counts, ctx.metas = [len(p) for p in saved], [tensor_meta(rows[r0:r0 + step]) for r0 in starts]
        ctx.storage, ctx.step, ctx.eps, ctx.shape = storage, step, eps, x.shape
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: Tensor):
        weight, *flat = ctx.saved_tensors  # once: checkpointing's hooks unpack a tensor only once
        grad_rows = grad.reshape(-1, grad.shape[-1])
        dx = grad_rows.new_empty(grad_rows.shape[0], ctx.shape[-1]) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, grad.dtype)) if ctx.needs_input_grad[1] else None
        start = 0
        for j, (count, meta) in enumerate(zip(ctx.counts, ctx.metas, strict=True)):
            rows = unpack_tensor(flat[start:start + count], ctx.storage, meta)
            start += count
            g = grad_rows[j * ctx.step:(j + 1) * ctx.step]
            h = rows.to(torch.float32)
            r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)
            h = h * r  # not in place: native storage decodes to the saved input itself
            if dw is not None:
                dw.add_((g * h.to(rows.dtype)).sum(0))
            if dx is not None:
                dh = (g * weight).to(torch.float32)
                mean = (dh * h).mean(-1, keepdim=True)
                torch.mul(dh.sub_(h.mul_(mean)), r, out=dx[j * ctx.step:(j + 1) * ctx.step])
        return (dx.view(ctx.shape) if dx is not None else None,
                dw.to(weight.dtype) if dw is not None else None, None, None)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF Llama's RMSNorm forward, op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _recomputed(fn: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs) or torch.compiler.is_compiling():
        return fn(*inputs)  # nothing saved, or the compiler chooses what to keep
    return RecomputedFunction.apply(fn, *inputs)


def _global_module_hooks() -> bool:
    module = nn.modules.module
    return bool(module._global_forward_pre_hooks or module._global_forward_hooks)


class RecomputedActivation(nn.Module):
    """An elementwise activation written as several ops (HF's NewGELU: pow, tanh, muls) keeping
    only its input: its own class's forward reruns in backward."""

    def forward(self, x: Tensor) -> Tensor:
        stock = partial(self.__dict__[ORIGINAL_CLASS_ATTR].forward, self)
        if not needs_saving(x, self):
            return stock(x)
        return _recomputed(stock, x)


class RecomputedGatedMLP(nn.Module):
    """HF Llama's MLP, ``down(act(gate(x)) * up(x))``, whose product keeps ``gate(x)`` and
    ``up(x)`` only (stock keeps ``act(gate(x))`` as well, and the activation its input)."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module

    def _gated(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.act_fn(gate) * up

    def forward(self, x: Tensor) -> Tensor:
        if self._sliceable(x):
            saved = self.__dict__.get(RULE_ATTR, ("native",))[0]
            storages = (self.gate_proj.lessmem_spec.storage, saved, self.down_proj.lessmem_spec.storage)
            return SlicedGatedMLPFunction.apply(
                self._unstored_act(saved) or self.act_fn, x, self.gate_proj.weight, self.gate_proj.bias,
                self.up_proj.weight, self.up_proj.bias, self.down_proj.weight, self.down_proj.bias, storages)
        return self.down_proj(_recomputed(self._gated, self.gate_proj(x), self.up_proj(x)))

    def _sliceable(self, x: Tensor) -> bool:
        """Whether the whole MLP may run as one ``SlicedGatedMLPFunction`` (backward in token
        slices): three token linears without token pooling, gate and up keeping x alike, in
        eager mode without autocast, and no hooks on the projections but saved_storage's (the
        projections' own forwards do not run)."""
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if not all(isinstance(p, CompressedLinear) and p.lessmem_spec.kernel[0] == 1 for p in projections):
            return False
        if self.gate_proj.lessmem_spec.storage != self.up_proj.lessmem_spec.storage:
            return False
        if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type) or keeps_stock_path(self.gate_proj, x):
            return False
        return all(_only_saved_storage_hooks(p) for p in projections) and not _global_module_hooks()

    def _unstored_act(self, saved: str) -> Callable[[Tensor], Tensor] | None:
        """The activation's own class's forward, without its storage or hooks, where the sliced
        Function may run that instead of the module: the activation stores nothing or stores in
        ``saved``, the storage the gate is decoded from in backward, and a value decoded from a
        storage comes back from it unchanged (int8: ~0.1% of elements an ulp off), so the module
        would only repack it (a quantize and a decode per slice). Else None: the module runs."""
        act = self.act_fn
        storage = getattr(act, "lessmem_storage", act.__dict__.get(RULE_ATTR, ("native",))[0])
        if storage not in ("native", saved) or not _only_saved_storage_hooks(act):
            return None
        return partial(act.__dict__.get(ORIGINAL_CLASS_ATTR, type(act)).forward, act)


def _only_saved_storage_hooks(module: nn.Module) -> bool:
    return set(module._forward_pre_hooks) | set(module._forward_hooks) <= set(module.__dict__.get(HOOK_IDS_ATTR, ()))


class RecomputedRMSNorm(nn.Module):
    """HF Llama's RMSNorm where saved tensors are lossy (``saved_storage``): keeps its input only
    (stock keeps the normalised input as well), packed a slice of rows at a time, and takes its
    gradient slice by slice from the decoded input (``SlicedRMSNormFunction``). With native saved
    tensors the stock forward runs (the closed-form backward sums the input gradient's terms in
    another order: not bit for bit)."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, x: Tensor) -> Tensor:
        storage = self.__dict__.get(RULE_ATTR, ("native",))[0]
        if storage == "native" or not needs_saving(x, self) or torch.compiler.is_compiling():
            return self.__dict__[ORIGINAL_CLASS_ATTR].forward(self, x)
        return SlicedRMSNormFunction.apply(x, self.weight, self.variance_epsilon, storage)


class SlicedSDPAttention(nn.Module):
    """An HF attention module (Llama's) whose saved tensors are lossy (``saved_storage``): its own
    forward runs, with its ``F.scaled_dot_product_attention`` call (no mask, no dropout) taken by
    ``SlicedAttentionFunction``, which keeps q, k, v packed and decodes them a batch slice at a
    time in backward. Where the out-projection keeps its input whole in the same storage, the
    attention packs its output for both (no rerun in backward, no second code). With native saved
    tensors the stock call runs."""

    o_proj: nn.Module

    def forward(self, *args, **kwargs):
        stock = partial(self.__dict__[ORIGINAL_CLASS_ATTR].forward, self)
        storage = self.__dict__.get(RULE_ATTR, ("native",))[0]
        if storage == "native" or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return stock(*args, **kwargs)
        with _SlicedAttention(storage, self._shares_output(storage)):
            return stock(*args, **kwargs)

    def _shares_output(self, storage: str) -> bool:
        """Whether the out-projection keeps its input as ``storage`` codes of the whole of it (a lessmem
        token linear, k = 1, that storage, a weight that trains): then it keeps the code the attention
        packs of its output, and keeping it costs the attention nothing more."""
        proj = getattr(self, "o_proj", None)
        return (isinstance(proj, CompressedLinear) and proj.weight.requires_grad
                and proj.lessmem_spec.kernel[0] == 1 and proj.lessmem_spec.storage == storage)


class _SlicedAttention(TorchFunctionMode):
    """Routes the supported ``F.scaled_dot_product_attention`` calls to ``SlicedAttentionFunction``."""

    def __init__(self, storage: str, share_output: bool) -> None:
        super().__init__()
        self.storage, self.share_output = storage, share_output

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = (*args, *(kwargs.get(n) for n in ("query", "key", "value")))[:3]
            options = {n: kwargs.get(n, default) for n, default in
                       (("attn_mask", None), ("dropout_p", 0.0), ("enable_gqa", False))}
            if (len(args) == 3 and options == {"attn_mask": None, "dropout_p": 0.0, "enable_gqa": False}
                    and set(kwargs) <= {"attn_mask", "dropout_p", "enable_gqa", "is_causal", "scale"}
                    and q.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0]
                    and any(t.requires_grad for t in (q, k, v))):
                return SlicedAttentionFunction.apply(q, k, v, bool(kwargs.get("is_causal", False)),
                                                     kwargs.get("scale"), self.storage, self.share_output)
        return func(*args, **kwargs)
