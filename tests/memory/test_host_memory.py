"""Host memory: offloaded blocks stream from the one host copy of the weights that already exists, undo copies no
weights, page-locking in place is released (or falls back to pageable memory with a note), and the inference-mode
model is trained through aliases, not a copy."""
import ctypes
import json
import mmap
import os
import re
import subprocess
import sys
import tempfile
import types
import warnings

import pytest
import torch
from live_tensors import live_cpu_storages
from torch.utils._python_dispatch import TorchDispatchMode
from two_stream import make_lora_model, train_steps

from tightrope.memory import host_memory
from tightrope.memory.blocks import discover_blocks
from tightrope.memory.host_memory import HostNeeds
from tightrope.memory.plan_cost import Prediction
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy, StrategyError
from tightrope.nodes import host
from tightrope.nodes.dataset_nodes import TightropeLoadDataset
from tightrope.nodes.demo_nodes import TightropeDemoEncoders, TightropeDemoImages, TightropeDemoModel
from tightrope.nodes.lora_node import TightropeLoraSetup
from tightrope.nodes.strategy_node import TightropeMemoryStrategy
from tightrope.nodes.train_node import TightropeTrain


def live_cpu_bytes() -> int:
    """Bytes of every distinct CPU storage some Python-visible tensor holds (params included)."""
    return sum(live_cpu_storages().values())


class AllocationTally(TorchDispatchMode):
    """Bytes of new storages that aten ops return (an allocation, not a view of an input)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        seen = set()
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.data_ptr() not in inputs and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    self.bytes += s.nbytes()
        return out


def frozen_block_bytes(model, itemsize=4):
    return sum(p.numel() * itemsize for n, p in model.named_parameters() if "_blocks" in n and not p.requires_grad)


def test_offload_adds_no_host_copy_and_undo_gives_the_original_storages_back():
    model = make_lora_model()
    loader = {n: p.data for n, p in model.named_parameters()}  # what ComfyUI's ModelPatcher keeps holding
    storages = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    base = live_cpu_bytes()
    rt = MemoryRuntime(model, Strategy.of(offload_fraction=1.0, compute_dtype="fp32"), "cpu")
    with AllocationTally() as attach:
        rt.apply()
    try:
        lo = rt.offload
        # the slots and the NaN placeholders (scalars) are all that attach allocates; the old master copy
        # added every offloaded block's weights again
        assert attach.bytes - lo.slot_bytes() < 4096
        assert lo.host_copy_bytes() == 0
        sources = {src.untyped_storage().data_ptr() for lay in lo.layouts.values() for src in lay.sources}
        assert sources <= set(storages.values())
        assert live_cpu_bytes() - base - lo.slot_bytes() < 4096  # on the CPU "device" the slots are host memory
        train_steps(model, steps=1, runtime=rt)
    finally:
        with AllocationTally() as undo:
            rt.undo()
    assert undo.bytes == 0  # the old undo copied every offloaded weight (`.to(copy=True)`)
    assert {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()} == storages
    assert all(p.data is loader[n] or torch.equal(p.data, loader[n]) for n, p in model.named_parameters())
    del rt, lo
    assert live_cpu_bytes() <= base * 1.02


def test_dtype_conversion_makes_one_host_copy_per_block_freed_at_undo():
    model = make_lora_model()
    storages = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    base = live_cpu_bytes()
    with MemoryRuntime(model, Strategy.of(offload_fraction=1.0, weight_dtype="bf16", compute_dtype="bf16"),
                       "cpu") as rt:
        # the converted copy is unavoidable: bf16 bytes of every offloaded frozen weight (each tensor aligned)
        assert frozen_block_bytes(model, 2) <= rt.offload.host_copy_bytes() < frozen_block_bytes(model, 2) * 1.1
        during = live_cpu_bytes() - base - rt.offload.slot_bytes()
        assert during <= rt.offload.host_copy_bytes() + 4096
    assert {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()} == storages
    del rt
    assert live_cpu_bytes() <= base * 1.02


def test_inference_mode_model_trains_on_aliases_not_a_copy():
    from tightrope.demo.model import demo_model
    with torch.inference_mode():  # as ComfyUI builds models
        model = demo_model(0)
        model.flux = type(model.flux)(model.flux.params)
        model.flux.load_state_dict(demo_model(0).flux.state_dict())
    assert all(p.is_inference() for p in model.flux.parameters())
    reference = demo_model(0).flux
    before = {n: p.untyped_storage().data_ptr() for n, p in model.flux.named_parameters()}
    with torch.inference_mode(False), AllocationTally() as tally, model.training_module() as module:
        assert module is not model.flux
        assert {n: p.untyped_storage().data_ptr() for n, p in module.named_parameters()} == before
        assert not any(p.is_inference() or p.requires_grad for p in module.parameters())
    assert tally.bytes < 4096  # the old path cloned the whole model
    # the alias trains: gradients flow through the frozen weights to an input, exactly as through the original
    x = torch.randn(1, 16, 64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.inference_mode(False), model.training_module() as module:
        module.img_in(x).square().sum().backward()
    reference.img_in(xr).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)


# -- host RAM in the plan ------------------------------------------------------------------------------------------
def _prediction(offloaded, host_acts=0):
    return Prediction(peak_bytes=1, step_s=1.0, bound_s=1.0, compute_s=1.0, compile_s=0.0, offloaded=tuple(offloaded),
                      breakdown={"host_activations": host_acts})


def test_host_needs_count_the_model_once_and_copies_only_for_another_dtype():
    model = make_lora_model()
    blocks = [b.module for b in discover_blocks(model)]
    own = HostNeeds.measure(model, blocks, None, budget_bytes=1 << 30)
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert own.model_bytes == weights and own.copy_bytes == [0] * len(blocks)
    bf16 = HostNeeds.measure(model, blocks, torch.bfloat16, budget_bytes=1 << 30)
    assert [c // 2 for c in bf16.copy_bytes] == pytest.approx(
        [sum(p.numel() for p in b.parameters() if not p.requires_grad) for b in blocks], rel=0.05)  # alignment
    assert own.need(_prediction([0, 1], host_acts=100)) == weights + 100
    assert bf16.need(_prediction([0, 1])) == weights + bf16.copy_bytes[0] + bf16.copy_bytes[1]


def test_host_budget_refusals_name_the_least_host_ram():
    """Without a change measured to fit (test_host_plan.py has those), a refusal names the host RAM the run needs."""
    needs = HostNeeds(budget_bytes=10 << 20, model_bytes=8 << 20, model_8bit_bytes=2 << 20, copy_bytes=[3 << 20] * 2)
    fits, copies = (_prediction([]), "a"), (_prediction([0, 1]), "b")
    assert needs.keep_fitting([copies, fits]) == [fits]
    with pytest.raises(StrategyError, match=r"needs 14\.0 MiB .*6\.0 MiB of converted weight copies.*nothing the "
                                            r"planner can change fits it: raise host_ram_budget_gb to at least 14\.0"):
        needs.keep_fitting([copies])
    small = HostNeeds(budget_bytes=4 << 20, model_bytes=8 << 20, model_8bit_bytes=2 << 20, copy_bytes=[0, 0])
    with pytest.raises(StrategyError, match=r"model's own weights take 8\.0 MiB .* host-RAM budget of 4\.0 MiB "
                                            r"\(host_ram_budget_gb\); nothing .* at least 8\.0 MiB"):
        small.keep_fitting([fits])
    assert "Host RAM: 8.0 MiB of your 10.0 MiB" in needs.explain(fits[0])


def test_default_host_budget_is_available_ram_plus_the_model(monkeypatch):
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 10 << 30)
    model = make_lora_model()
    needs = HostNeeds.measure(model, [b.module for b in discover_blocks(model)], None)
    assert needs.budget_bytes == (10 << 30) + needs.model_bytes - host_memory.AUTO_HOST_MARGIN_BYTES
    if os.path.exists("/proc/meminfo"):
        monkeypatch.undo()
        assert 0 < host_memory.available_host_bytes() < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_default_host_budget_does_not_add_weights_in_a_file_mapping(monkeypatch, tmp_path):
    """Weights in a file mapping (ComfyUI's dynamic VRAM maps the model file) are page cache the kernel already counts
    as available, and the run page-locks them: the budget adds only the model's anonymous bytes (the old budget added
    them all, W too much for a mapped model)."""
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 10 << 30)
    model = make_lora_model()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    (tmp_path / "weights.bin").write_bytes(b"".join(p.detach().numpy().tobytes() for p in frozen))
    with open(tmp_path / "weights.bin", "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(mapping, dtype=torch.float32)
    offset = 0
    for p in frozen:
        p.data, offset = flat[offset:offset + p.numel()].view(p.shape), offset + p.numel()
    needs = HostNeeds.measure(model, [b.module for b in discover_blocks(model)], None)
    mapped = flat.nbytes
    assert host_memory.file_backed_bytes({flat.data_ptr(): mapped}) == mapped
    assert needs.budget_bytes == (10 << 30) + needs.model_bytes - mapped - host_memory.AUTO_HOST_MARGIN_BYTES
    assert 0 < needs.model_bytes - mapped < mapped  # the LoRA weights are anonymous, still added


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
def test_weights_in_shared_memory_are_added_to_the_budget(monkeypatch, tmp_path):
    """Weights the ranks of a machine share sit in /dev/shm (memory/shared_host.py): tmpfs pages, which available
    memory leaves out, unlike the page cache of a file on disk. The budget used to subtract them as page cache,
    so a plan made once they were shared (a second Train node under torchrun) was short by the model's size."""
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 10 << 30)
    nbytes = 1 << 20
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="tightrope-test-")
    try:
        os.ftruncate(fd, nbytes)
        shared = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
        on_disk = tmp_path / "weights.bin"
        on_disk.write_bytes(bytes(nbytes))
        mapped = torch.UntypedStorage.from_file(str(on_disk), shared=True, nbytes=nbytes)
        assert host_memory.file_backed_bytes({shared.data_ptr(): nbytes}) == 0
        assert host_memory.file_backed_bytes({mapped.data_ptr(): nbytes}) == nbytes  # a file on disk: page cache
        model = torch.nn.Linear(512, 512, bias=False).requires_grad_(False)
        model.weight.data = torch.empty(0).set_(shared, 0, (512, 512))  # the shared bytes as the model's weight
        needs = HostNeeds.measure(torch.nn.Sequential(model), [model], None)
        assert needs.model_bytes == nbytes
        assert needs.budget_bytes == (10 << 30) + needs.model_bytes - host_memory.AUTO_HOST_MARGIN_BYTES
    finally:
        os.close(fd)
        os.unlink(path)


def test_auto_strategy_explains_host_ram_next_to_vram(tmp_path):
    with host.headless(tmp_path):
        (folder,) = TightropeDemoImages().make("imgs", 4, 32, 0)
        vae, clip = TightropeDemoEncoders().load(0)
        (dataset,) = TightropeLoadDataset().load(folder=folder, vae=vae, clip=clip, resolution=32, caption_dropout=0.0,
                                                 use_repeats=True, strict=False)
        (lora,) = TightropeLoraSetup().setup(4, 4.0, False, 0.0, "attention", "default")
        spec = TightropeMemoryStrategy.INPUT_TYPES()["required"]
        values = {k: v[1]["default"] for k, v in spec.items()} | {"compute_dtype": "fp32", "mode": "auto",
                                                                   "vram_budget_gb": 1.0}
        (auto,) = TightropeMemoryStrategy().make(**values, host_ram_budget_gb=64.0)
        widgets = {k: v[1]["default"] for k, v in TightropeTrain.INPUT_TYPES()["required"].items()}
        _, _, report = TightropeTrain().train(**(widgets | dict(steps=1, batch_size=2, device="cpu")),
                                              model=TightropeDemoModel().load(0)[0], dataset=dataset, lora=lora,
                                              strategy=auto)
    assert re.search(r"Predicted .* peak of your 1\.0 GiB.* Host RAM: 7\.1 MiB of your 64\.00 GiB \(the model's "
                     r"7\.1 MiB", report), report


FRAGMENTED_HEAP = """
import json, torch
from tightrope.memory.host_memory import release_freed_host_memory

def rss():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmRSS:'))

base = rss()
chunks = [torch.ones(16 * 1024) for _ in range(3200)]  # 64 KiB each, below glibc's mmap threshold: heap memory
tail = torch.ones(16 * 1024)  # live at the top of the heap: glibc cannot trim the freed chunks below it by itself
del chunks
freed = rss()
trimmed = release_freed_host_memory()
print(json.dumps({"base": base, "freed": freed, "after": rss(), "trimmed": trimmed}))
"""


@pytest.mark.skipif(host_memory._glibc_malloc_trim() is None, reason="malloc_trim is glibc's (Linux)")
def test_freed_heap_memory_goes_back_to_the_os():
    """200 MiB of small tensors freed below a live one stay in the process's RSS under glibc (what a ComfyUI server
    kept after every run: +10 % of its loaded size) until release_freed_host_memory returns the free pages."""
    # glibc's default tunables (a low mmap threshold, as GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4096, leaves no
    # heap to trim: the test then fails, measured)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    proc = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, env=env,
                          check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert r["freed"] - r["base"] > 150 * mib, r  # without the trim the freed memory is still resident
    assert r["trimmed"] and r["after"] - r["base"] < 20 * mib, r


def test_undo_returns_freed_host_memory_after_restoring_the_model(monkeypatch):
    from tightrope.memory import runtime
    model = make_lora_model()
    calls = []
    monkeypatch.setattr(runtime, "release_freed_host_memory", lambda: calls.append(
        all(not isinstance(m.__dict__.get("forward"), type(lambda: 0)) for m in model.modules())))
    with MemoryRuntime(model, Strategy.of(offload_fraction=1.0, compute_dtype="fp32"), "cpu") as rt:
        train_steps(model, steps=1, runtime=rt)
        assert calls == []
    assert calls == [True]  # once, after every block forward was restored


def _no_psutil_no_proc(monkeypatch):
    """An install without psutil (peft brings it; `pip install --no-deps` does not), off Linux (no /proc)."""
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    real_exists = os.path.exists
    monkeypatch.setattr(host_memory.os.path, "exists", lambda p: p != "/proc/meminfo" and real_exists(p))


def test_available_host_memory_without_psutil_on_windows(monkeypatch):
    """GlobalMemoryStatusEx's ullAvailPhys, what psutil reads on Windows: before, None, and every auto strategy failed
    with 'the available host RAM cannot be read on this system'."""
    _no_psutil_no_proc(monkeypatch)

    class Kernel32:
        @staticmethod
        def GlobalMemoryStatusEx(pointer):
            status = pointer._obj
            assert status.dwLength == ctypes.sizeof(status) == 64  # as Windows checks it
            status.ullAvailPhys = 7 << 30
            return 1
    monkeypatch.setattr(ctypes, "windll", types.SimpleNamespace(kernel32=Kernel32), raising=False)
    assert host_memory.available_host_bytes() == 7 << 30


def test_without_psutil_elsewhere_the_refusal_says_what_to_do(monkeypatch):
    _no_psutil_no_proc(monkeypatch)
    monkeypatch.delattr(ctypes, "windll", raising=False)
    assert host_memory.available_host_bytes() is None
    model = make_lora_model()
    with pytest.raises(StrategyError, match=r"give host_ram_budget_gb, or install psutil \(pip install psutil\)"):
        HostNeeds.measure(model, [b.module for b in discover_blocks(model)], None)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "psutil", None)
    if os.path.exists("/proc/meminfo"):  # Linux without psutil: /proc/meminfo
        assert 0 < host_memory.available_host_bytes() < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
