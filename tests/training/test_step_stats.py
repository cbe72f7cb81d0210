"""Step figures: a step is the whole step (optimizer included), and memory is reported as allocated, reserved and
device used, with CPU's "not measured" kept explicit."""
import torch
from demo_setup import demo_session

from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.stats import StepTimer
from tightrope.training import trainer
from tightrope.training.training_run import report

CPU = torch.device("cpu")
COUNTERS = {"h2d_bytes": 0, "d2h_bytes": 0, "graphs": 0}


def test_the_measured_step_includes_clipping_and_the_optimizer(tmp_path, monkeypatch):
    events = []
    real_end, real_make = MemoryRuntime.end_step, trainer.make_optimizer
    real_clip = torch.nn.utils.clip_grad_norm_

    def end_step(self):
        events.append("end_step")
        return real_end(self)

    def make_optimizer(*args):
        opt = real_make(*args)
        step = opt.step
        opt.step = lambda *a, **k: (events.append("optimizer.step"), step(*a, **k))[1]
        return opt

    monkeypatch.setattr(MemoryRuntime, "end_step", end_step)
    monkeypatch.setattr(trainer, "make_optimizer", make_optimizer)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **k: (events.append("clip"), real_clip(*a, **k))[1])
    trainer.train(demo_session(tmp_path, max_grad_norm=1.0), 2, device=CPU)
    assert events == ["clip", "optimizer.step", "end_step"] * 2


def test_cpu_stats_have_every_memory_field_at_zero_and_the_report_says_not_measured(tmp_path):
    result = trainer.train(demo_session(tmp_path), 1, device=CPU)
    stats = result.stats[-1]
    assert {k: stats[k] for k in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")} == \
        {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0, "device_used_bytes": 0}
    assert "peak memory not measured (CPU)" in report(result, 1)


def test_report_shows_allocated_reserved_and_device_used(tmp_path):
    result = trainer.train(demo_session(tmp_path), 1, device=CPU)
    stats = dict(result.stats[-1], peak_allocated_bytes=3 << 30, peak_reserved_bytes=4 << 29,
                 device_used_bytes=5 << 29)
    line = report(result.advanced(stats=(stats,)), 1).splitlines()[2]
    assert "peak allocated 3.00 GiB, reserved 2.00 GiB, device used 2.50 GiB" in line


def test_cuda_timer_reads_reserved_and_device_used_over_the_baseline(monkeypatch):
    """The CUDA calls replaced by a fake device: 1 GiB used before the model, 7 GiB at the step's end."""
    free = iter([15 << 30, 9 << 30])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (next(free), 16 << 30))
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 4 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 << 30)
    timer = StepTimer(torch.device("cuda", 0))  # made before the model is placed: the baseline
    timer.start(COUNTERS)
    stats = timer.stop(COUNTERS, 0.0)
    assert (stats.peak_allocated_bytes, stats.peak_reserved_bytes, stats.device_used_bytes) == \
        (4 << 30, 5 << 30, 6 << 30)
