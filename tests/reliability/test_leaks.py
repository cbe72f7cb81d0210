"""No leaks: ten training runs in one process keep RSS (and CUDA memory) flat and leave the base model as given."""
import gc
import os

import pytest
import torch
from reliability_kit import assert_untouched, lora, snapshot, strategy, train_node, world

from tightrope.nodes.demo_nodes import TightropeDemoModel

RUNS, WARMUP, SLACK_MB = 10, 2, 30


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _ten_runs(out, device, measure):
    model, dataset, spec, strat = world(out)
    before = snapshot(model.flux)
    readings = []
    for i in range(RUNS):
        with torch.inference_mode():  # as ComfyUI calls nodes
            result = train_node(model, dataset, spec, strat, steps=2, save_every=2, device=device,
                                filename_prefix=f"rt/run{i}")
        assert result[0].step == 2
        del result
        gc.collect()
        readings.append(measure())
    assert_untouched(model.flux, before)
    return readings


def _growth_after_warmup(readings):
    """Growth over the runs after the warm-up, from the reading after the last warm-up run: the first runs create
    what a process keeps for good (allocator pools; on CUDA the cuBLAS workspaces, one per handle and stream, taken
    from the caching allocator on the first matmul on each stream), which is no leak."""
    return max(readings[WARMUP:]) - readings[WARMUP - 1]


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS is read from /proc (Linux)")
def test_ten_runs_keep_rss_flat_and_the_model_untouched(out):
    rss = _ten_runs(out, "cpu", _rss_mb)
    growth = _growth_after_warmup(rss)
    assert growth < SLACK_MB, f"RSS grew {growth:.1f} MB over runs {WARMUP + 1}-{RUNS}: {[round(r) for r in rss]}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory can only be measured on a CUDA device")
def test_ten_runs_keep_cuda_memory_flat(out):
    allocated = _ten_runs(out, "cuda", torch.cuda.memory_allocated)
    growth = _growth_after_warmup(allocated)
    assert growth < 1 << 20, f"{growth} bytes stayed allocated on the device after runs {WARMUP + 1}-{RUNS}: " \
        f"{[a - allocated[WARMUP - 1] for a in allocated]}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory exists only with CUDA")
def test_a_cuda_run_gives_its_pinned_host_memory_back():
    """Activation offload's host copies live in one arena page-locked in place (memory/activation_host.py), of the
    step's bytes, not in PyTorch's caching host allocator (a power of two per buffer, kept page-locked for the life
    of the process): the driver reports the arena page-locked during the run and not after the runtime's undo, and
    the caching allocator holds no more than before (a ComfyUI server goes back to its idle footprint)."""
    import mmap

    from two_stream import make_lora_model, train_steps

    from tightrope.memory.runtime import MemoryRuntime
    from tightrope.memory.strategy import Strategy

    def cached() -> int:
        stats = torch.cuda.host_memory_stats()  # the pool (active + cached blocks): "reserved_bytes" where torch
        return max(stats.get("reserved_bytes.current", 0), stats.get("allocated_bytes.current", 0))  # has it

    torch.cuda.init()
    before = cached()
    model = make_lora_model()
    strat = Strategy.of(offload_fraction=1.0, checkpoint="all", activation_offload=True, compute_dtype="fp32")
    with MemoryRuntime(model, strat, "cuda", activation_min_bytes=0) as rt:
        train_steps(model, steps=2, runtime=rt)  # the first step sizes the arena, the second copies into it
        torch.cuda.synchronize()
        host = rt.acts.host
        arena = host._arena
        assert arena is not None and host.pinned and arena.is_pinned(), "the arena was not page-locked"
        assert host.arena_bytes == -(-host.high_water // mmap.PAGESIZE) * mmap.PAGESIZE
    gc.collect()
    assert not arena.is_pinned(), "the arena is still page-locked after the run"
    assert cached() == before, f"{cached() - before} pinned bytes stay cached by torch's host allocator after the run"


def test_the_baseline_is_taken_after_the_warmup():
    """Workspaces made once by the first run are no leak; growth after the warm-up is."""
    once = [0, 8 << 20] + [8 << 20] * (RUNS - 2)
    assert _growth_after_warmup(once) == 0
    assert _growth_after_warmup(once[:-1] + [9 << 20]) == 1 << 20


def test_a_failed_run_leaves_the_model_untouched_too(out):
    model = TightropeDemoModel().load(0)[0]
    _, dataset, spec, strat = world(out)
    before = snapshot(model.flux)
    for bad in (dict(lora_spec=lora(rank=512, alpha=512.0)), dict(strat=strategy(offload_fraction=1.0,
                                                                                  checkpoint="all"), steps=0)):
        with pytest.raises(ValueError):
            train_node(**({"model": model, "dataset": dataset, "lora_spec": spec, "strat": strat} | bad))
    real = model.predict
    model.predict = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("mid-step failure"))
    with pytest.raises(RuntimeError, match="mid-step failure"):
        train_node(model, dataset, spec, strategy(offload_fraction=1.0, checkpoint="all", activation_offload=True))
    model.predict = real
    assert_untouched(model.flux, before)
