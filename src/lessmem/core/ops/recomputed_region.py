"""Recomputed regions (``CompressionPlan.recompute``): a module that keeps only its inputs for
backward and reruns its own forward there, under ``torch.utils.checkpoint`` (non-reentrant) with
torch's RNG state restored, so dropout draws the same masks. Exact: the gradients are stock's.

A region can also be a run of sibling modules that its parent calls one after another, each on the
one before's output (``"conv1+bn1+relu+maxpool"``, a ResNet's stem: no module holds them). The first
module then runs the whole run under the checkpoint and returns its own output; each next one
returns its output from that run, after checking that its input is the output the one before
returned (same tensor, unchanged): a parent that does anything between them fails by name.

Three things a plain checkpoint leaves to the user are handled here:

- what the region keeps goes through autograd's saved tensors (``_KeptInputs``), so every byte
  count sees it, and an input modified in place later fails backward loudly, as autograd does;
- BatchNorm running statistics are updated once per step, not again by the rerun;
- a forward that does not rerun to the same output (an RNG or state outside torch's, an input
  modified in place by the region itself) is a RuntimeError naming the module, never a silently
  wrong gradient."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

RUN_JOIN = "+"  # joins the sibling modules of a recomputed run: "conv1+bn1+relu+maxpool"

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


class RecomputedRun:
    """A run of sibling modules recomputed as one region: its first module runs them all under one
    checkpoint (``RecomputedForward`` of their chain); each module's ``forward`` is a ``RunMember``."""

    def __init__(self, modules: list[nn.Module], names: list[str]) -> None:
        self.names, self.label = names, "+".join(names)
        self.members = [RunMember(self, i, m) for i, m in enumerate(modules)]
        chain = _Chain(modules, [m.original for m in self.members])
        self.region = RecomputedForward(chain, self.label)
        self.pending: list[Tensor] = []  # outputs of the run's later modules, not yet handed out
        self.handed: Tensor | None = None  # the output handed out last

    def first(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() or not self.region._needs_grad((x,), {}):
            self.pending, self.handed = [], None
            return self.members[0].original(x)
        self.handed, *self.pending = self.region(x)
        return self.handed

    def next(self, i: int, x: Tensor) -> Tensor:
        engaged = torch.is_grad_enabled() and self.region._needs_grad((x,), {})
        if self.handed is None and not engaged:  # no gradient needed: the module as it is
            return self.members[i].original(x)
        if x is not self.handed or not self.pending:
            self.pending, self.handed = [], None
            raise RuntimeError(f"lessmem: recomputed run {self.label!r}: {self.names[i]!r} got another tensor than "
                               f"{self.names[i - 1]!r} returned; a run's modules must be called one after another, "
                               "each on the one before's output")
        self.handed = self.pending.pop(0)
        out = self.handed
        if not self.pending:
            self.handed = None
        return out


class RunMember:
    """The ``forward`` of a run's i-th module (``uncompress`` puts ``replaced`` back)."""

    def __init__(self, run: RecomputedRun, i: int, module: nn.Module) -> None:
        self.run, self.i = run, i
        self.replaced = module.__dict__.get("forward")
        self.original = module.forward

    def __call__(self, x: Tensor) -> Tensor:
        return self.run.first(x) if self.i == 0 else self.run.next(self.i, x)


class _Chain(nn.Module):
    """A run's forwards composed, returning every module's output; the modules are registered so
    that the region's checks (parameters, BatchNorm statistics) see them."""

    def __init__(self, modules: list[nn.Module], forwards: list[Callable[..., Any]]) -> None:
        super().__init__()
        self.members = nn.ModuleList(modules)
        self.forwards = forwards

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        outs = []
        for f in self.forwards:
            x = f(x)
            outs.append(x)
        return tuple(outs)


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


def in_regions(name: str, regions: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``regions`` (module names, or runs joined by ``RUN_JOIN``), a
    run's member, or inside one of them."""
    return any(name == m or name.startswith(f"{m}.") for r in regions for m in r.split(RUN_JOIN))


def recomputed_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every module ``compress`` made recomputed (alone or in a run)."""
    return {n: m for n, m in model.named_modules() if _recomputing(m.__dict__.get("forward"))}


def _recomputing(forward: Any) -> bool:
    return isinstance(forward, (RecomputedForward, RunMember))
