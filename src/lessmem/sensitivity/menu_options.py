"""What a menu offers (``MenuOptions``): the pooling kernels and storages of conv / token-linear
inputs, the lossy storages of BatchNorm and GELU / SiLU inputs and of saved-tensor regions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lessmem.core import STORAGES, UNBIASED_STORAGES

DEFAULT_KERNELS = (1, 2, 4, 8)
# Token-linear inputs unpooled by default: pooling tokens is a deterministic (biased) error that
# one-draw criteria cannot tell from stochastic rounding's, which averages out over steps. On the
# tiny Llama at 0.12x the knapsack over pooled token options trained to val_ppl 12.10 against 7.97
# without them (8 paired seeds, docs/proofs.md); menu.token_kernels=[1,2,4,8] offers them.
DEFAULT_TOKEN_KERNELS = (1,)
# Every lossy width for BatchNorm / activation / saved-region items (the knapsack decides; 1-bit
# norm inputs cost the most gradient error, and the criterion says so).
LOSSY_STORAGES = ("bf16", "int8", "int4", "int2", "int1")


@dataclass(frozen=True)
class MenuOptions:
    """kernels x storages: every conv option (kernel 1 with native storage is the exact one);
    token_kernels x storages: every token-linear option; norm_storages / act_storages /
    saved_storages: the lossy storages probed for each BatchNorm input, GELU / SiLU input and
    saved-tensor region (``lessmem.sensitivity.regions``: a module, other than an item, whose own
    forward saves floating tensors); empty: none."""

    kernels: tuple[int, ...] = DEFAULT_KERNELS
    token_kernels: tuple[int, ...] = DEFAULT_TOKEN_KERNELS
    storages: tuple[str, ...] = UNBIASED_STORAGES
    norm_storages: tuple[str, ...] = LOSSY_STORAGES
    act_storages: tuple[str, ...] = LOSSY_STORAGES
    saved_storages: tuple[str, ...] = ()
    from_bn: bool = True
    recompute: bool = False  # the model's blocks and runs of layers as recompute options (bytes, seconds)

    def __post_init__(self) -> None:
        for field in ("kernels", "token_kernels"):
            kernels = sorted(set(getattr(self, field)))
            if not kernels or kernels[0] != 1 or "native" not in self.storages:
                raise ValueError(f"the menu needs kernel 1 and native storage (the exact option) among positive "
                                 f"{field}, got {field} {kernels}, storages {list(self.storages)}")
        for s in (*self.storages, *self.norm_storages, *self.act_storages, *self.saved_storages):
            if s not in STORAGES:
                raise ValueError(f"unknown storage {s!r}; choose from {', '.join(STORAGES)}")

    @classmethod
    def kernel_only(cls, kernels: tuple[int, ...] = DEFAULT_KERNELS) -> MenuOptions:
        """Pooling alone (conv and token-linear inputs): native storage, no BatchNorm / activation /
        saved-region options."""
        return cls(kernels, kernels, ("native",), (), (), (), from_bn=False, recompute=False)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> MenuOptions:
        """The options a config node lists (the ``menu`` group, ``adaptive``); other keys are
        ignored and a field it leaves out keeps its default."""
        switches = ("from_bn", "recompute")
        given: dict[str, Any] = {f.name: tuple(int(k) if f.name.endswith("kernels") else str(k) for k in cfg[f.name])
                                 for f in fields(cls) if f.name in cfg and f.name not in switches}
        for name in switches:
            if name in cfg:
                if not isinstance(cfg[name], bool):
                    raise ValueError(f"menu.{name} must be true or false, got {cfg[name]!r}")
                given[name] = cfg[name]
        return cls(**given)


DEFAULT_MENU = MenuOptions()
