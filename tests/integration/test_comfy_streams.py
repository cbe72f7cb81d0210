"""ComfyUI's own Flux (blocks that add residuals in place, ComfyUI's cast ops) trained by the ComfyUI adapter with the
runtime's CUDA branches under the simulated streams (tests/helpers/sim_streams.py), inside ComfyUI's python: layer
offload, activation offload (32x32 latents: 256 tokens, above its 64 KiB floor), optimizer offload and the EMA on, 2
micro-batches per step. The run must equal the plain CPU run bit for bit (the simulation changes only when copies
run) and leave no ordering or lifetime hazard: what tests/training/test_trainer_streams.py checks for the reference
Flux, on the model users train."""
import pytest
from comfy_env import REPO, needs_comfyui, run_on_tiny_flux

pytestmark = needs_comfyui

RUNNER = """
    import sys
    sys.path.insert(0, HELPERS)
    from pathlib import Path
    from sim_branches import cuda_branches
    from sim_streams import simulated_cuda
    from tightrope.demo.conditioning import demo_conditioning
    from tightrope.memory.strategy import Strategy
    from tightrope.training.data.builder import dataset_from_conditioning
    from tightrope.training.lora.layers import LoraSpec
    from tightrope.training.train_config import TrainConfig
    from tightrope.training.training_run import run_training_node
    ckpt, loras = ARGS
    STRATEGY = Strategy.of(compute_dtype=COMPUTE, offload_fraction=0.5, checkpoint="all", activation_offload=True,
                           optimizer_offload=True)

    class Patch:  # pytest's monkeypatch, as much of it as the simulation uses
        def __init__(self):
            self.undo = []
        def setattr(self, obj, name, value):
            self.undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        def close(self):
            for obj, name, value in reversed(self.undo):
                setattr(obj, name, value)

    def train(patcher, prefix):
        g = torch.Generator().manual_seed(0)
        cond = demo_conditioning(patcher, "a red circle", 8, 0)
        data = dataset_from_conditioning({"samples": torch.randn(4, 16, 32, 32, generator=g)}, cond)
        config = TrainConfig(learning_rate=1e-2, batch_size=1, grad_accumulation=2, ema_decay=0.9)
        session, _, _ = run_training_node(config, 3, session=None, model=patcher, dataset=data,
                                          lora=LoraSpec(rank=4), strategy=STRATEGY, device="cpu",
                                          save_dir=Path(loras), filename_prefix=prefix, save_every=0, progress=None,
                                          should_stop=None)
        return session

    out = {}
    with torch.inference_mode():  # as ComfyUI runs nodes
        p = comfy.sd.load_diffusion_model(ckpt)
        plain = train(p, "plain")
        patch = Patch()
        try:
            with simulated_cuda(patch) as sim:  # its exit raises on any hazard left
                cuda_branches(patch)
                simulated = train(p, "simulated")
                c = sim.counters
                out["copied"] = sorted(s.name for s in sim.streams if s.deferred)
                out["counters"] = [c.deferred, c.flushed, c.checked_copies, c.blocking, c.host_ops, c.compute_ops]
        except AssertionError as e:
            out["hazards"] = str(e)
        finally:
            patch.close()
    out["losses"] = [list(plain.losses), list(simulated.losses)] if "hazards" not in out else []
    out["lora_equal"] = "hazards" not in out and all(
        torch.equal(simulated.lora_state[k], v) for k, v in plain.lora_state.items())
    out["ema_equal"] = "hazards" not in out and all(
        torch.equal(simulated.ema_state[k], v) for k, v in plain.ema_state.items())
    result(out)
"""


@pytest.mark.usefixtures("comfyui_python")  # Tightrope's requirements installed in ComfyUI's python
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_comfyui_flux_trains_under_simulated_streams_as_on_the_cpu(tmp_path, compute):
    runner = f"    HELPERS = {str(REPO / 'tests' / 'helpers')!r}\n    COMPUTE = {compute!r}\n" + RUNNER
    r = run_on_tiny_flux(tmp_path, runner)
    assert "hazards" not in r, r["hazards"]
    assert r["copied"] == ["acts", "ema", "layers", "optimizer"]  # every CUDA branch queued copies
    deferred, flushed, checked, blocking, host_ops, compute_ops = r["counters"]
    assert deferred > 0 and flushed == deferred and checked == deferred + blocking and host_ops > 0
    assert compute_ops > 0
    plain, simulated = r["losses"]
    assert len(plain) == 3 and simulated == plain
    assert r["lora_equal"] and r["ema_equal"]
