"""Small LoRA-like weights, optimizer-like changes, and the EMA computed by the plain loop: the reference the EMA
tests (tests/training/test_ema.py, tests/memory/test_stream_simulation.py) hold memory/ema.py to."""
import torch


def lora_like_weights(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    """A few LoRA-like weights, one over a page (4 KiB) and one bf16 (gathered to fp32 as a LoRA in bf16 is)."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.nn.Parameter(torch.randn(16, 3, generator=g)),
            "b": torch.nn.Parameter(torch.randn(3000, generator=g)),
            "c": torch.nn.Parameter(torch.randn(4, 8, generator=g).bfloat16())}


def change_weights(params: dict, g: torch.Generator) -> None:
    """An optimizer-like change of every weight."""
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype), alpha=0.1)


def reference_ema(params: dict, decay: float, steps: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """The EMA after each of `steps` changes, by the plain loop: shadow = lerp(shadow, w, 1 - d), d = min(decay, (1 + n)
    / (10 + n)), in fp32."""
    g, out = torch.Generator().manual_seed(seed), []
    shadow = {k: p.detach().float().clone() for k, p in params.items()}
    for n in range(steps):
        change_weights(params, g)
        d = min(decay, (1 + n) / (10 + n))
        shadow = {k: torch.lerp(shadow[k], p.detach().float(), 1 - d) for k, p in params.items()}
        out.append(shadow)
    return out
