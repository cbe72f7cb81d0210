"""`make gpu-check` / `make gpu-bench`: without CUDA one line and exit 0; the CPU dry run (`--device cpu --tiny`)
runs the same orchestration on tiny models and writes everything the GPU run writes."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tightrope.bench import gpu_bench, gpu_check, gpu_run, measure
from tightrope.bench.cli import main as bench_main
from tightrope.bench.gpu_run import Run
from tightrope.bench.measure import fits
from tightrope.memory.layer_offload import LayerOffload, in_backward

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the real run applies")


@needs_no_cuda
@pytest.mark.parametrize("command", ["gpu-check", "gpu-bench"])
def test_without_cuda_it_says_so_in_one_line_and_exits_0(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GPU_CHECK_OUT", raising=False)
    assert bench_main([command]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"{command}: no CUDA device here (torch {torch.__version__}")
    assert not any(tmp_path.iterdir())  # no results folder for a run that did not happen


@pytest.mark.parametrize("main", [gpu_check.main, gpu_bench.main])
def test_cpu_needs_tiny(main, capsys):
    with pytest.raises(SystemExit) as exit_request:
        main(["--device", "cpu"])
    assert exit_request.value.code == 2 and "--device cpu runs only as a dry run: add --tiny" in capsys.readouterr().err


def _dry(main, tmp_path):
    lines = []
    rc = main(["--device", "cpu", "--tiny", "--out", str(tmp_path)], log=lines.append)
    name = "gpu-check" if main is gpu_check.main else "gpu-bench"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    table = (tmp_path / f"{name}.md").read_text()
    assert lines[-1] == table.rstrip("\n")  # the summary printed is the one written
    assert {"device", "device_name", "torch", "cuda", "date", "peft"} <= set(data["meta"]) and data["meta"]["peft"]
    assert data["meta"]["torch"] == torch.__version__ and data["meta"]["device"] == "cpu"
    failed = [s for s in data["summary"] if s["passed"] is False]
    assert rc == (1 if failed else 0) and ("FAILED" in table) == bool(failed)
    for s in data["summary"]:
        assert f"| {s['what']} |" in table
    return rc, data


def test_gpu_check_dry_run(tmp_path):
    rc, data = _dry(gpu_check.main, tmp_path)
    assert rc == 0, data["summary"]  # every check passes, both device spellings included (defect 1)
    sections = data["sections"]
    equivalence, ordering = sections["equivalence"], sections["stream_ordering"]
    assert [r["config"] for r in equivalence] == ["off0.5 ckpt-off", "off1 ckpt-all actoff",
                                                  "off0.5 ckpt-every2 actoff depth2",
                                                  "off1 ckpt-all actoff chunks3 optoff"]
    assert all("max_diff[cpu]" in r for r in equivalence + ordering)  # the plain spelling matched the reference
    assert [r["injection"] for r in ordering] == ["sleep on compute stream", "sleep on copy streams"]
    assert sections["leak_test"]["passed"] and sections["leak_test"]["counts"]["tests"] == 1
    headline = sections["headline"]["configs"]
    # the planner's least-peak configuration (depth 0, token chunks, the optimizer on the host) included, and the
    # ones without each of those before it
    assert [(r["strategy"]["offload_fraction"], r["strategy"]["prefetch_depth"], r["strategy"]["token_chunks"],
             r["strategy"]["optimizer_offload"]) for r in headline] == [
        (0.9, 1, 1, False), (1.0, 1, 1, False), (1.0, 0, 1, False), (1.0, 1, 8, False), (1.0, 0, 8, False),
        (1.0, 0, 8, True), (1.0, 1, 8, True), (0.0, 1, 1, False), (0.0, 1, 8, False), (0.0, 1, 8, True)]
    assert headline[5]["opt_s"] > 0 and "optoff" in headline[5]["label"]
    assert all(not r["oom"] and r["step_s"] > 0 for r in headline)
    assert headline[0]["bound_s"] > 0 and headline[1]["h2d_bytes"] >= headline[0]["h2d_bytes"] > 0
    # the targets run under their caps: the least-peak configuration at 4 GB, the planner's 4 GB plan at 4 GB, the
    # least-peak configuration at 3 GB (the aim, the slowest, last)
    capped = sections["headline"]["capped"]
    assert [(r["cap_bytes"], r["strategy"]["prefetch_depth"], r["strategy"]["token_chunks"],
             r["strategy"]["optimizer_offload"]) for r in capped] == [(4e9, 0, 8, True), (4e9, 1, 8, True),
                                                                     (3e9, 0, 8, True)]
    assert all(r["fits"] is None and r["step_s"] > 0 for r in capped)  # no cap on the CPU
    assert [r["uncapped_step_s"] for r in capped] == [headline[5]["step_s"], headline[6]["step_s"],
                                                      headline[5]["step_s"]]
    assert sum(" GB cap | no cap on the CPU: " in line for line in _table_lines(tmp_path)) == 3


def _table_lines(folder):
    return (folder / "gpu-check.md").read_text().splitlines()


def test_a_capped_row_says_whether_it_fits_and_only_a_crash_fails():
    """The capped rows are the 4 GB target and the 3 GB aim: missing them is a figure, not a failed check."""
    GiB = 2**30
    ran = {"label": "off1.00/d0 optoff", "cap_bytes": 4e9, "target": "runs within 4.0 GB", "step_s": 4.6,
           "uncapped_step_s": 4.0, "peak_reserved_bytes": 3.5 * GiB, "device_used_bytes": 3.6 * GiB}
    rows = [ran | {"fits": True}, ran | {"fits": False, "peak_reserved_bytes": 3.9 * GiB, "device_used_bytes": 4.2e9},
            ran | {"oom": True, "fits": False, "error": "CUDA out of memory. Tried to allocate 20.00 MiB"},
            ran | {"failed": True, "error": "ValueError: shapes"}]
    run = Run("gpu-check", torch.device("cpu"), True, Path("."), log=lambda line: None)
    gpu_check._summarise_capped(run, "flux-dev 2048 px", rows)
    (what, fit, target, passed), over, oom, crash = run.summary
    assert what == "flux-dev 2048 px off1.00/d0 optoff under a 4 GB cap" and target == "runs within 4.0 GB"
    assert fit == ("fits: peak reserved 3.50 GiB (3.76 GB), device used 3.87 GB; 4.6 s/step = 1.15x uncapped")
    assert passed is None and over[1].startswith("over the cap: peak reserved 3.90 GiB") and over[3] is None
    assert oom[1] == "does not fit: out of memory (CUDA out of memory. Tried to allocate 20.00 MiB)" and oom[3] is None
    assert crash[1] == "crashed: ValueError: shapes" and crash[3] is False


def test_memory_budget_caps_the_allocator_and_lifts_the_cap_after_an_error(monkeypatch):
    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with pytest.raises(torch.cuda.OutOfMemoryError), measure.memory_budget(torch.device("cuda", 0), 4e9):
        assert fractions == [0.05]
        raise torch.cuda.OutOfMemoryError("out of memory")
    assert fractions == [0.05, 1.0]
    with measure.memory_budget(torch.device("cpu"), 4e9):
        pass
    assert fractions == [0.05, 1.0]  # no cap on the CPU


def test_gpu_check_fails_on_a_broken_schedule(tmp_path, monkeypatch):
    """Negative control: a conductor that forgets to reload blocks in backward fails the check and the exit code."""
    real_load = LayerOffload.load

    def forgetful_load(self, index):
        if in_backward() and index in self.layouts and index not in self.resident:
            return
        real_load(self, index)

    monkeypatch.setattr(LayerOffload, "load", forgetful_load)
    monkeypatch.setattr(LayerOffload, "unpack", lambda self, ref: self.area.view(ref.dtype).as_strided(
        ref.shape, ref.stride, ref.offset))  # saved weights read from whatever slot 0 holds
    monkeypatch.setattr(gpu_check, "_headline", lambda *a: {"skipped": "negative control"})
    monkeypatch.setattr(gpu_check.cuda_checks, "run_leak_test", lambda *a: {"skipped": "negative control"})
    lines = []
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)], log=lines.append) == 1
    rows = json.loads((tmp_path / "gpu-check.json").read_text())["sections"]["equivalence"]
    broken = next(r for r in rows if r["config"] == "off0.5 ckpt-off")
    assert not broken["passed"] and "max_diff[cpu]" not in broken  # the plain spelling fails the comparison
    assert "| FAIL |" in lines[-1]


def test_gpu_bench_dry_run(tmp_path):
    rc, data = _dry(gpu_bench.main, tmp_path)
    sections = data["sections"]
    assert sections["bandwidth"]["pinned"] > 0 and sections["bandwidth"]["pageable"] > 0
    plans = sections["planner"]["plans"]
    assert len(plans) == 2 and all(p["predicted_peak_bytes"] <= p["budget_bytes"] for p in plans)
    assert all(p["measured"]["step_s"] > 0 and p["predicted_bound_s"] > 0 for p in plans)
    compiled = sections["compile"]
    assert compiled["speedup"] > 0 and compiled["compiled"]["strategy"]["compile"] == "per_block"
    assert rc == 0


def test_fits_counts_what_the_allocator_reserved_and_the_device_lost():
    """Allocated alone leaves out the cache and fragmentation: a run whose reserved memory or device use exceeds the
    budget does not fit, though its allocated peak is under it."""
    GiB = 2**30
    under = {"peak_allocated_bytes": 1 * GiB, "peak_reserved_bytes": 1.5 * GiB, "device_used_bytes": 1.8 * GiB}
    assert fits(under, 2 * GiB)
    assert not fits(under | {"peak_reserved_bytes": 3 * GiB}, 2 * GiB)
    assert not fits(under | {"device_used_bytes": 2.5 * GiB}, 2 * GiB)
    assert not fits(under | {"oom": True}, 2 * GiB)


def test_a_configuration_that_crashes_is_a_failed_row_and_the_rest_still_run(tmp_path, monkeypatch):
    """One headline row raising (a bug in code no GPU has run yet, e.g. the token chunks) used to end the section:
    the rows after it, the offload-0 twins and every step / bound ratio were lost."""
    real = measure.MemoryRuntime

    def runtime(model, strategy, device):
        flat = strategy.to_flat()
        if (flat["token_chunks"], flat["prefetch_depth"], flat["offload_fraction"], flat["optimizer_offload"]) == \
                (8, 1, 1.0, False):
            raise ValueError("chunked block: shapes do not match (simulated)")
        return real(model, strategy, device)

    monkeypatch.setattr(measure, "MemoryRuntime", runtime)
    run = Run("gpu-check", torch.device("cpu"), True, tmp_path, log=lambda line: None)
    headline = gpu_check._headline(torch.device("cpu"), gpu_check.TINY, lambda line: None, run)
    gpu_check._summarise_headline(run, headline)
    rows = headline["configs"]
    crashed = [r for r in rows if r.get("failed")]
    assert len(rows) == 10 and [r["strategy"]["token_chunks"] for r in crashed] == [8]
    assert crashed[0]["error"] == "ValueError: chunked block: shapes do not match (simulated)"
    assert "Traceback" in crashed[0]["traceback"] and not measure.skipped(rows[-1])  # the twin after it ran
    assert all(r["bound_s"] > 0 for r in rows if not r.get("failed") and r["strategy"]["offload_fraction"] > 0)
    assert run.failed() and any("crashed: ValueError" in result for _, result, _, _ in run.summary)


@pytest.mark.parametrize("line,version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024", "535.183.01"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16)  Tue Sep "
     "23 09:55:41 UTC 2025", "580.95.05"),
    ("something else", None)])
def test_the_results_name_the_nvidia_driver(tmp_path, line, version):
    """Page-locking read-only memory in place differs between drivers: the results say which one ran."""
    (tmp_path / "version").write_text(line + "\nGCC version: gcc 12\n")
    assert gpu_run.nvidia_driver(str(tmp_path / "version")) == version
    assert gpu_run.nvidia_driver(str(tmp_path / "missing")) is None


def test_a_crash_under_a_cap_keeps_the_headline_rows_measured_before_it(tmp_path, monkeypatch):
    """A CUDA error that leaves the device unusable is raised out of run_config: the headline section then crashes,
    and the rows measured uncapped must still be in the JSON (the device time that made them is gone)."""
    def unusable(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    monkeypatch.setattr(gpu_check, "_capped", unusable)
    run = Run("gpu-check", torch.device("cpu"), True, tmp_path, log=lambda line: None)
    run.section("headline", lambda: gpu_check._headline(torch.device("cpu"), gpu_check.TINY, lambda line: None, run))
    sections = json.loads((tmp_path / "gpu-check.json").read_text())["sections"]
    assert "illegal memory access" in sections["headline"]["error"]
    rows = sections["headline_rows_so_far"]
    assert len(rows) == 10 and all(r["step_s"] > 0 for r in rows)


def test_a_headline_row_reports_activation_offloads_arena_against_the_bytes_copied(monkeypatch):
    """The measured record holds the page-locked arena of activation offload (memory/activation_host.py), and the
    summary sets it against the bytes a step copies out: the host-memory figure issue 13 asks of a GPU."""
    from fake_cudart import FakeCudart

    from tightrope.bench.grid import BenchConfig
    from tightrope.bench.models import build_bench_model
    from tightrope.memory.activation_offload import ActivationOffload
    from tightrope.memory.strategy import Strategy

    fake, real_init = FakeCudart(), ActivationOffload.__init__
    monkeypatch.setattr(ActivationOffload, "__init__", lambda self, device, **kw: real_init(self, device, **kw,
                                                                                             cudart=fake))
    strategy = Strategy.of(checkpoint="all", activation_offload=True, compute_dtype="fp32")
    bench = build_bench_model("tiny", lora_rank=4, init_device="cpu")
    r = measure.run_config(bench, BenchConfig(strategy, batch=1, resolution=256), "cpu", steps=2, warmup=1)
    host = r["activation_host"]
    assert host["pinned"] and 0 < host["high_water_bytes"] <= host["arena_bytes"] < host["high_water_bytes"] + 2**16
    assert host["pageable_buffers"] > 0 and not fake.live  # the first step's; the arena given back at undo
    run = Run("gpu-check", torch.device("cpu"), True, Path("."), log=lambda line: None)
    r |= {"peak_reserved_bytes": 2**30, "peak_allocated_bytes": 2**29, "device_used_bytes": 2**30, "bound_ratio": 1.0,
          "bound_s": 1.0, "label": "off0.00 ckpt-all actoff", "d2h_bytes": 3 * 2**30}
    r["activation_host"] = {"arena_bytes": 3 * 2**30 + 4096, "high_water_bytes": 3 * 2**30, "pinned": True,
                            "pageable_buffers": 12}
    gpu_check._summarise_headline(run, {"model": "flux-dev", "resolution": 2048, "configs": [r]})
    line = next(s for s in run.summary if s[0].endswith("activation host memory"))
    assert line[1] == "arena 3.00 GiB page-locked for 3.00 GiB copied out per step; 12 pageable buffers (the " \
                      "first step's)"


def test_the_accumulation_rows_train_micro_batches_as_the_cpu_reference(monkeypatch):
    """gpu-check's rows of 3 steps x 2 micro-batches (bench/cuda_checks.accumulation_matrix), on the CPU with
    activation offload's arena page-locked through the driver's model: the arena starts over for each micro-batch."""
    from fake_cudart import FakeCudart

    from tightrope.bench import cuda_checks
    from tightrope.memory.activation_offload import ActivationOffload

    real_init, arenas = ActivationOffload.__init__, []

    def init(self, device, **kw):
        real_init(self, device, **kw, cudart=FakeCudart())
        arenas.append(self.host)
    monkeypatch.setattr(ActivationOffload, "__init__", init)
    rows = cuda_checks.run_matrix("cpu", cuda_checks.accumulation_matrix(), log=lambda line: None)
    assert [r["config"] for r in rows] == ["off1 ckpt-all actoff 3x2 micro", "off0.5 ckpt-all actoff optoff 3x2 micro"]
    assert all(r["passed"] for r in rows), [r.get("error") for r in rows]
    assert arenas and all(a.pageable_buffers and a.high_water for a in arenas)
    assert cuda_checks.accumulation_matrix()[0] in cuda_checks.matrix() and \
        cuda_checks.accumulation_matrix()[0] not in cuda_checks.matrix(tiny=True)


def test_bench_help_names_every_subcommand():
    """`tightrope bench --help` lists the subcommands the README names (found by a helper: it showed only the grid's
    flags); every name main() dispatches is in it."""
    import inspect
    import re

    from tightrope.bench import cli as bench_cli
    dispatched = set(re.findall(r'argv\[:1\] == \["([a-z-]+)"\]', inspect.getsource(bench_cli.main)))
    assert dispatched >= {"gpu-check", "gpu-bench", "headline-plan", "reserved-replay"}
    shown = bench_cli.build_parser().format_help()
    assert all(name in shown for name in dispatched), dispatched


def test_the_files_written_before_the_end_say_the_run_is_incomplete(tmp_path):
    """gpu-check writes its JSON and summary after every section and headline row, so that a run stopped at its time
    limit (scripts/gpu_session.sh: timeout, then the device tool's kill) keeps what it measured. Those files must not
    read as a whole run: the summary said "all checks passed" for a run stopped in its leak test, headline missing."""
    run = Run("gpu-check", torch.device("cpu"), True, tmp_path, log=lambda line: None)
    run.section("equivalence", lambda: run.add("equivalence matrix vs CPU", "4/4", "all", True))

    def summary_now():
        return (tmp_path / "gpu-check.md").read_text().splitlines()[-1], \
            json.loads((tmp_path / "gpu-check.json").read_text())["complete"]

    line, complete = summary_now()
    assert line.startswith("INCOMPLETE (stopped, or still running, between sections); nothing failed so far")
    assert complete is False and "all checks passed" not in line
    seen = run.section("leak_test", summary_now)  # stopped in a section that writes nothing itself: named too
    assert seen[0].startswith("INCOMPLETE (stopped, or still running, in section 'leak_test'")

    def headline():
        run.write()  # as _headline does after each row
        return summary_now()

    line, complete = run.section("headline", headline)
    assert line.startswith("INCOMPLETE (stopped, or still running, in section 'headline'") and complete is False
    run.add("leak test", "grew", "flat", False)
    run.write()
    assert "; FAILED so far" in summary_now()[0]
    assert run.finish() == 1
    line, complete = summary_now()
    assert line.startswith("FAILED; wall") and complete is True
