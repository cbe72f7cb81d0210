"""The probe's host-to-device bandwidth test takes a pinned buffer from torch's caching host allocator (on CUDA): it
must run before the probe's runtime is undone, whose undo gives cached pinned blocks back to the OS, or a ComfyUI
server that only plans would keep that buffer page-locked."""
import torch
import torch.nn.functional as F
from two_stream import make_batch, make_lora_model

from tightrope.memory import probe as probe_module
from tightrope.memory import runtime as runtime_module
from tightrope.memory.probe import probe_model
from tightrope.memory.strategy import Strategy


def test_bandwidth_is_measured_before_the_undo_releases_pinned_host_memory(monkeypatch):
    order = []
    measure = probe_module.measure_h2d_bandwidth
    release = runtime_module.release_freed_host_memory
    monkeypatch.setattr(probe_module, "measure_h2d_bandwidth",
                        lambda *a, **k: order.append("bandwidth") or measure(*a, **k))
    monkeypatch.setattr(runtime_module, "release_freed_host_memory", lambda: order.append("release") or release())

    def inputs():
        batch, target = make_batch()
        return batch, lambda out: F.mse_loss(out, target)
    torch.manual_seed(0)
    prof = probe_model(make_lora_model(), inputs, "cpu", Strategy.of(compute_dtype="fp32", offload_fraction=1.0),
                       repeats=0)
    assert order == ["bandwidth", "release"]
    assert prof.h2d_bytes_per_s > 0
