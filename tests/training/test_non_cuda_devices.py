"""Devices other than CUDA. ComfyUI runs on Apple's MPS, Intel's XPU, DirectML ('privateuseone') or the CPU
(`--cpu`); the Train node's device is 'auto' (CUDA when available, else the CPU), 'cuda' or 'cpu', so on those
machines it trains on the CPU. Every stream, event, page-locking and allocator call of the runtime is behind a
`device.type == "cuda"` check: a step on any other device takes the plain synchronous path. Here every torch.cuda
function raises, and a step with every strategy feature on (layer offload with pin_memory, activation offload,
optimizer offload, checkpointing, EMA) must still train on the CPU."""
import pytest
import torch
from demo_setup import demo_session

from tightrope.memory.devices import normalize_device
from tightrope.memory.strategy import Strategy
from tightrope.training.trainer import train

CPU = torch.device("cpu")


@pytest.fixture
def no_cuda_calls(monkeypatch):
    """Every public torch.cuda function and class raises (is_available and is_initialized answer False, as on a Mac)."""
    called = []

    def trap(name):
        def raiser(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"torch.cuda.{name} called on a machine without CUDA")
        return raiser
    for name in dir(torch.cuda):
        if name.startswith("_") or name in ("is_available", "is_initialized", "device_count"):
            continue
        value = getattr(torch.cuda, name)
        if callable(value) and not isinstance(value, type(torch)):
            monkeypatch.setattr(torch.cuda, name, trap(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    return called


def test_every_strategy_feature_trains_off_cuda_without_touching_torch_cuda(tmp_path, no_cuda_calls):
    strategy = Strategy.of(compute_dtype="bf16", offload_fraction=0.5, pin_memory=True, activation_offload=True,
                           optimizer_offload=True, checkpoint="all")
    session = demo_session(tmp_path, strategy=strategy, ema_decay=0.9)
    done = train(session, 2, device=CPU)
    assert done.step == 2 and no_cuda_calls == []


@pytest.mark.parametrize("name", ["mps", "xpu", "privateuseone"])
def test_a_device_without_an_index_is_named_as_its_tensors_name_theirs(name):
    """MPS, XPU and DirectML tensors report index 0 ('mps:0'), and torch.device('mps') != torch.device('mps:0'):
    the runtime compares tensors' devices with its own (activation offload skipped every activation on 'mps')."""
    assert normalize_device(name) == torch.device(name, 0)
    assert normalize_device(f"{name}:1") == torch.device(name, 1)
    assert normalize_device("cpu:0") == CPU


def test_compile_on_a_gpu_without_triton_is_refused_before_anything_is_placed(monkeypatch):
    """PyTorch for Windows ships no Triton, which inductor builds CUDA kernels with: compile=per_block failed at the
    first step (TritonMissing inside inductor, a traceback). Refused when the runtime is made, in one line. (CUDA is
    faked here: the check comes before any CUDA call.)"""
    from tightrope.demo.model import demo_model
    from tightrope.memory import block_compile, runtime
    from tightrope.memory.strategy import StrategyError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(block_compile, "_triton_installed", lambda: False)
    import types
    gpu = types.SimpleNamespace(major=8, minor=6, name="NVIDIA GeForce RTX 3090")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    with pytest.raises(StrategyError, match=r"compile=per_block builds the blocks' GPU kernels with Triton, which is "
                                            r"not installed .*pip install triton-windows"):
        runtime.MemoryRuntime(demo_model(), Strategy.of(compile="per_block"), "cuda:0")
    monkeypatch.setattr(block_compile, "_triton_installed", lambda: True)
    per_block = Strategy.of(compile="per_block").compiler
    block_compile.check_compiler(per_block, torch.device("cuda", 0))  # installed: no refusal
    gpu.major, gpu.minor, gpu.name = 6, 1, "NVIDIA GeForce GTX 1080"  # Pascal: inductor's GPUTooOldForTriton
    with pytest.raises(StrategyError, match=r"needs a GPU of CUDA capability 7.0 or newer; cuda:0 \(NVIDIA GeForce "
                                            r"GTX 1080\) has 6.1: set the Memory Strategy's compile to off"):
        block_compile.check_compiler(per_block, torch.device("cuda", 0))
    monkeypatch.setattr(block_compile, "_triton_installed", lambda: False)
    block_compile.check_compiler(per_block, CPU)  # the CPU's kernels are C++, not Triton's
    block_compile.check_compiler(Strategy.of(compile="off").compiler, torch.device("cuda", 0))


@pytest.mark.parametrize("platform,cxx,advice", [
    ("win32", None, "MSVC's cl: run ComfyUI from a Developer Command Prompt"),
    ("linux", "tightrope-no-such-g++", "tightrope-no-such-g\\+\\+: install it, or set CXX to another"),
    # the compiler searched is named (CXX, clang++ on macOS), not g++ whatever it was (a review helper)
    ("darwin", "tightrope-no-such-clang++", "tightrope-no-such-clang\\+\\+: install it, or set CXX to another")])
def test_compile_on_the_cpu_without_a_cpp_compiler_is_refused_before_training(monkeypatch, platform, cxx, advice):
    """Inductor builds CPU kernels with a C++ compiler: without one (Windows outside a Visual Studio prompt, a Linux
    image without g++) the first step failed deep in inductor. On Linux inductor's real search is run over a compiler
    that does not exist (its config); Windows's search (cl) is replaced by its failure. The real search passes here
    (this machine has g++)."""
    from torch._inductor import config, cpp_builder, exc
    from tightrope.demo.model import demo_model
    from tightrope.memory import block_compile, runtime
    from tightrope.memory.strategy import StrategyError
    per_block = Strategy.of(compile="per_block").compiler
    block_compile.check_compiler(per_block, CPU)

    def no_cl():
        raise exc.InvalidCxxCompiler()  # no arguments before torch 2.13
    if platform == "win32":
        monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_cl)
    monkeypatch.setattr(block_compile.sys, "platform", platform)
    # inductor's own patch (monkeypatch's undo of a config attribute deleted it: later compiles failed)
    refusal = (r"compile=per_block builds the blocks' CPU kernels with a C\+\+ compiler, and inductor found none "
               rf"\({advice}.*set the Memory Strategy's compile")
    with config.patch({"cpp.cxx": (None, cxx)} if cxx else {}), pytest.raises(StrategyError, match=refusal):
        runtime.MemoryRuntime(demo_model(), Strategy.of(compile="per_block"), "cpu")
    assert config.cpp.cxx != (None, cxx)
    block_compile.check_compiler(Strategy.of(compile="per_block", compile_backend="aot_eager").compiler, CPU)
    block_compile.check_compiler(Strategy.of(compile="off").compiler, CPU)


def test_compile_on_windows_without_cl_is_refused_under_an_older_torch_too(monkeypatch):
    """torch 2.11 and older say a missing cl on Windows with a RuntimeError raised from the FileNotFoundError of
    running it (cpp_builder.check_compiler_exist_windows), not InvalidCxxCompiler: refused all the same. Another
    RuntimeError of that search (MSVC without its English language pack) stays inductor's own."""
    from torch._inductor import cpp_builder
    from tightrope.memory import block_compile
    from tightrope.memory.strategy import StrategyError
    per_block = Strategy.of(compile="per_block").compiler

    def fails(message, cause):
        def search():
            raise RuntimeError(message) from cause
        return search
    monkeypatch.setattr(block_compile.sys, "platform", "win32")
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", fails("Compiler: cl is not found.", FileNotFoundError(2)))
    with pytest.raises(StrategyError, match=r"inductor found none \(MSVC's cl: run ComfyUI from a Developer Command"):
        block_compile.check_compiler(per_block, CPU)
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", fails("Torch.compile() is only support MSVC with English "
                                                                 "language pack", None))
    with pytest.raises(RuntimeError, match="English language pack"):
        block_compile.check_compiler(per_block, CPU)


def test_an_old_gpu_with_triton_installed_is_told_its_capability_not_to_install_triton(monkeypatch):
    """torch's has_triton() is False on a GPU below capability 7.0 even with Triton installed: a GTX 1080 with Triton
    was told to install Triton. Simulated where torch reads it (the package, the current GPU's properties), not by
    replacing _triton_installed."""
    import sys
    import types
    import torch.utils._triton as torch_triton
    from torch._dynamo import device_interface
    from tightrope.memory import block_compile
    from tightrope.memory.strategy import StrategyError
    gpu = types.SimpleNamespace(major=6, minor=1, name="NVIDIA GeForce GTX 1080")
    monkeypatch.setattr(torch_triton, "has_triton_package", lambda: True)
    stub = types.ModuleType("triton")
    stub.backends = types.ModuleType("triton.backends")
    stub.backends.backends = {"nvidia": None}  # Triton's CUDA backend, no CPU one
    monkeypatch.setitem(sys.modules, "triton", stub)
    monkeypatch.setitem(sys.modules, "triton.backends", stub.backends)
    monkeypatch.setattr(device_interface.CudaInterface, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(device_interface.CudaInterface.Worker, "get_device_properties",
                        staticmethod(lambda device=None: gpu))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: gpu)
    with pytest.raises(StrategyError, match=r"needs a GPU of CUDA capability 7.0 or newer; cuda:0 \(NVIDIA GeForce "
                                            r"GTX 1080\) has 6.1"):
        block_compile.check_compiler(Strategy.of(compile="per_block").compiler, torch.device("cuda", 0))


@pytest.mark.parametrize("theirs,device,noted", [("mps", "auto", True), ("xpu", "auto", True),
                                                 ("privateuseone", "auto", True), ("cpu", "auto", False),
                                                 (None, "auto", False), ("mps", "cpu", False)])
def test_a_comfyui_on_another_accelerator_is_told_training_runs_on_the_cpu(monkeypatch, theirs, device, noted):
    """A Mac's ComfyUI runs on MPS; its Train node (device auto: CUDA when available) trains on the CPU. One line
    says so before the run, naming ComfyUI's device and what Tightrope trains on."""
    from tightrope.nodes import host, train_node
    notes = []
    monkeypatch.setattr(host, "comfyui_device_type", lambda: theirs)
    monkeypatch.setattr(host, "notify", notes.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    class Ran(Exception):
        pass

    def run(*args, **kwargs):
        raise Ran
    monkeypatch.setattr(train_node, "run_training_node", run)
    with pytest.raises(Ran):
        train_node.TightropeTrain().train(steps=1, save_every=0, filename_prefix="x", device=device, unique_id="7")
    assert notes == ([f"Train node 7 trains on the CPU (device auto): Tightrope trains on CUDA GPUs (NVIDIA, or AMD "
                      f"with ROCm) or the CPU, not on this ComfyUI's device '{theirs}'; expect CPU speed"] if noted
                     else [])
