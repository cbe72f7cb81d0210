"""What arrives on a strategy wire: a concrete Strategy, or a request to plan one from a VRAM budget."""
from __future__ import annotations

from dataclasses import dataclass

from ..memory.strategy import Strategy, StrategyError


@dataclass(frozen=True, kw_only=True)
class AutoStrategy:
    vram_budget_gb: float = 0.0
    """GPU memory to fit in; 0 means the free memory now, minus a safety margin."""
    host_ram_budget_gb: float = 0.0
    """Host RAM the run may occupy, the model's own weights included; 0 means what is available now plus the
    model's weights, minus a safety margin."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.vram_budget_gb <= 1024.0:
            raise StrategyError(f"vram_budget_gb={self.vram_budget_gb!r} is out of range: use 0 (free memory) or "
                                "a budget in GB up to 1024")
        if not 0.0 <= self.host_ram_budget_gb <= 65536.0:
            raise StrategyError(f"host_ram_budget_gb={self.host_ram_budget_gb!r} is out of range: use 0 (available "
                                "RAM) or a budget in GB up to 65536")


StrategyChoice = Strategy | AutoStrategy
