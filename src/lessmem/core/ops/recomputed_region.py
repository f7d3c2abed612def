"""Recomputed regions (``CompressionPlan.recompute``): a module that keeps only its inputs for
backward and reruns its own forward there, under ``torch.utils.checkpoint`` (non-reentrant) with
torch's RNG state restored, so dropout draws the same masks. Exact: the gradients are stock's.

Three things a plain checkpoint leaves to the user are handled here:

- what the region keeps goes through autograd's saved tensors (``_KeptInputs``), so every byte
  count sees it, and an input modified in place later fails backward loudly, as autograd does;
- BatchNorm running statistics are updated once per step, not again by the rerun;
- a forward that does not rerun to the same output (an RNG or state outside torch's, an input
  modified in place by the region itself) is a RuntimeError naming the module, never a silently
  wrong gradient."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

# Relative change of the output's sum of squares between the forward and its rerun that counts as
# a different output (the same kernels on the same inputs agree to the bit on CPU; CUDA's
# non-deterministic kernels to far less than this).
RERUN_TOLERANCE = 1e-5


class _KeptInputs(torch.autograd.Function):
    """Identity on a region's tensor inputs that saves them for backward (the region's rerun reads
    the same storages: no bytes added)."""

    @staticmethod
    def forward(ctx, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.save_for_backward(*inputs)
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor, ...]:
        ctx.saved_tensors  # noqa: B018  (unpacking checks the version counters: an input changed in place fails here)
        return grads


class RecomputedForward:
    """What a recomputed module's ``forward`` is (an instance attribute set by ``compress``;
    ``uncompress`` puts ``replaced`` back): the forward it had, run under a checkpoint when autograd
    would keep anything."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name
        self.replaced = module.__dict__.get("forward")  # an instance's own forward, if it had one
        self.original = module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not self._needs_grad(args, kwargs):
            return self.original(*args, **kwargs)
        positions = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
        kept = _KeptInputs.apply(*(args[i] for i in positions)) if positions else ()
        args = tuple(kept[positions.index(i)] if i in positions else a for i, a in enumerate(args))
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        versions = [t._version for t in tensors]
        state: dict[str, Any] = {"calls": 0}
        refused = RuntimeError(f"lessmem: module {self.name!r} modifies its input in place, so its forward "
                               "cannot be rerun in backward; leave it out of the plan's recompute")
        try:
            with set_checkpoint_early_stop(False):  # the rerun runs to the output, which is checked
                out = checkpoint(self._run, state, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        except RuntimeError as e:
            if _KeptInputs.__name__ in str(e):  # autograd's own refusal of an in-place change of a kept input
                raise refused from e
            raise
        if any(t._version != v for t, v in zip(tensors, versions, strict=True)):
            raise refused
        return out

    def _needs_grad(self, args: tuple, kwargs: dict) -> bool:
        return any(isinstance(a, Tensor) and a.requires_grad for a in (*args, *kwargs.values())) or any(
            p.requires_grad for p in self.module.parameters())

    def _run(self, state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        state["calls"] += 1
        if state["calls"] == 1:
            out = self.original(*args, **kwargs)
            state["fingerprint"] = _fingerprint(out)
            return out
        stats = [(b, b.clone()) for b in _running_stats(self.module)]
        try:
            out = self.original(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, before in stats:
                    buffer.copy_(before)
        first, again = state["fingerprint"], _fingerprint(out)
        if abs(again - first) > RERUN_TOLERANCE * max(abs(first), 1e-30):
            raise RuntimeError(f"lessmem: module {self.name!r} gave a different output when rerun in backward "
                               f"(sum of squares {first:.6g} then {again:.6g}): it draws from an RNG or state "
                               "outside torch's, so it cannot be recomputed; leave it out of the plan's recompute")
        return out


def _running_stats(module: nn.Module) -> Iterator[Tensor]:
    """The buffers a training-mode forward updates: BatchNorm's running statistics and counter."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats:
            yield from (b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None)


def _fingerprint(out: Any) -> float:
    """The outputs' summed squared norms (a reduction: no full-size temporary)."""
    with torch.no_grad():
        return sum(float(torch.linalg.vector_norm(t.detach(), dtype=torch.float32)) ** 2 for t in _tensors(out)
                   if t.is_floating_point())


def _tensors(out: Any) -> Iterator[Tensor]:
    if isinstance(out, Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


def recomputed_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every module ``compress`` made recomputed."""
    return {n: m for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), RecomputedForward)}
