"""bench/allocator_trace.py: the replay of a CUDA allocator trace (the format of torch.cuda.memory._snapshot's
device_traces; recording itself needs CUDA and runs in `make gpu-check`)."""
from __future__ import annotations

import os

from tightrope.bench import allocator_trace
from tightrope.bench.allocator_trace import ROOT, analyse, markdown, where

MiB = 1 << 20
OWN_OFFLOAD = {"filename": os.path.join(ROOT, "memory", "layer_offload.py"), "line": 10, "name": "load"}
OWN_ATTN = {"filename": os.path.join(ROOT, "training", "models", "reference_flux.py"), "line": 42, "name": "attn"}
TORCH_F = {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 7, "name": "linear"}
SELF = {"filename": allocator_trace.__file__, "line": 1, "name": "recording"}


def _e(action, addr, size, stream=1, frames=()):
    return {"action": action, "addr": addr, "size": size * MiB, "stream": stream, "frames": list(frames)}


def _trace():
    return [
        _e("segment_map", 1000, 20),                            # reserved 120
        _e("alloc", 1000, 20, frames=[OWN_OFFLOAD]),            # allocated 80
        _e("free_requested", 1000, 20),                         # allocated 60, waiting 20
        _e("free_requested", 5, 10),                            # a baseline tensor: allocated 50, waiting 30
        _e("free_completed", 1000, 20),                         # waiting 10
        _e("segment_map", 9000, 50, stream=2),                  # reserved 170: the peak
        _e("alloc", 9000, 30, stream=2, frames=[TORCH_F, OWN_ATTN]),  # the request: allocated 80
        _e("alloc", 9400, 15, stream=2, frames=[SELF, TORCH_F]),
        _e("segment_unmap", 1000, 20),                          # reserved 150
        _e("segment_map", 1000, 10),                            # reserved 160: a growth, not the peak
        _e("alloc", 1000, 5, frames=[OWN_OFFLOAD]),
    ]


def test_the_replay_finds_the_peak_of_reserved_memory_and_what_held_it():
    a = analyse(_trace(), {"reserved": 100 * MiB, "allocated": 60 * MiB})
    assert a["events"] == 11
    assert a["peak_reserved"] == 170 * MiB
    # just after the request that grew the cache to its peak: baseline 60 - 10 freed + 30 requested
    assert a["at_peak"] == {"allocated": 80 * MiB, "waiting_for_streams": 10 * MiB, "free_in_cache": 80 * MiB,
                            "recorded_live": 30 * MiB, "baseline_freed": 10 * MiB}
    assert a["grew_for"] == {"bytes": 30 * MiB, "stream": 2,
                             "site": "training/models/reference_flux.py:42 (attn)"}
    assert a["live_by_site"] == [{"site": "training/models/reference_flux.py:42 (attn)", "bytes": 30 * MiB,
                                  "count": 1}]
    assert a["growth_by_stream"] == {2: 50 * MiB, 1: 30 * MiB}
    assert [(g["index"], g["bytes"], g["request"]["site"]) for g in a["largest_growths"]] == [
        (5, 50 * MiB, "training/models/reference_flux.py:42 (attn)"),
        (0, 20 * MiB, "memory/layer_offload.py:10 (load)"),
        (9, 10 * MiB, "memory/layer_offload.py:10 (load)")]


def test_without_growth_the_peak_is_the_baseline():
    trace = [_e("alloc", 1, 5, frames=[OWN_OFFLOAD]), _e("free_requested", 1, 5), _e("free_completed", 1, 5)]
    a = analyse(trace, {"reserved": 100 * MiB, "allocated": 60 * MiB})
    assert a["peak_reserved"] == 100 * MiB and a["grew_for"] is None and a["largest_growths"] == []
    assert a["at_peak"]["allocated"] == 60 * MiB and a["at_peak"]["free_in_cache"] == 40 * MiB


def test_a_frame_is_ours_through_a_symlinked_checkout(tmp_path):
    # the device machine imports the package through a symlink (/tmp/pp/tightrope -> the checkout)
    link = tmp_path / "tightrope"
    link.symlink_to(ROOT.rstrip(os.sep))
    frames = [TORCH_F, {"filename": str(link / "memory" / "token_chunks.py"), "line": 3, "name": "run"}]
    assert where(frames) == "memory/token_chunks.py:3 (run)"
    assert where([SELF, TORCH_F, OWN_OFFLOAD]) == "memory/layer_offload.py:10 (load)"  # this module is not the answer
    assert where([TORCH_F]) == "functional.py:7 (linear)"
    assert where([]) == "<no Python frame>"


def test_the_report_names_the_request_and_the_sites():
    a = analyse(_trace(), {"reserved": 100 * MiB, "allocated": 60 * MiB})
    text = markdown(a, "offload 1.0, 2048 px")
    assert "| reserved | 170.0 |" in text and "| free in the cache (reserved - allocated - waiting) | 80.0 |" in text
    assert "a 30.0 MiB request on stream 2 at `training/models/reference_flux.py:42 (attn)`" in text
    assert "| `training/models/reference_flux.py:42 (attn)` | 30.0 | 1 |" in text
    assert "overflowed" not in text
    assert "**The trace overflowed its ring" in markdown(dict(a, truncated=True), "x")


def test_the_allocator_model_replays_the_steps_own_requests():
    """Two 100 MiB tensors, the first freed, then 150 MiB: the expandable-segment allocator maps 100 + 100 + 160 MiB
    (the 150 MiB cannot use the 100 MiB hole and grows the segment by 8 pages of 20 MiB). The GPU's segment events
    say 360 MiB too; a free only requested (another stream still using it) does not return its block yet."""
    trace = [_e("segment_map", 0, 100), _e("alloc", 0, 100), _e("segment_map", 100 * MiB, 100),
             _e("alloc", 100 * MiB, 100), _e("free_requested", 0, 100), _e("free_completed", 0, 100),
             _e("segment_map", 200 * MiB, 160), _e("alloc", 200 * MiB, 150),
             _e("free_requested", 5, 10)]  # a baseline tensor (allocated before the recording): not the model's
    m = allocator_trace.model_growth(trace, 50 * MiB)
    assert m == {"expandable_segments": True, "gpu_growth": 360 * MiB, "model_growth": 360 * MiB,
                 "model_peak_allocated": 250 * MiB}
    # the same requests when the first free never completes within the step: nothing to reuse, still 360
    held = [e for e in trace if not (e["action"] == "free_completed")]
    assert allocator_trace.model_growth(held, 0)["model_growth"] == 360 * MiB
    # without page mappings: cudaMalloc segments of the request's size (rounded to 2 MiB)
    plain = [e for e in trace if e["action"] not in ("segment_map",)]
    m = allocator_trace.model_growth(plain, 0)
    assert (m["expandable_segments"], m["model_growth"]) == (False, 350 * MiB)
    text = markdown(dict(analyse(trace, {"reserved": 50 * MiB, "allocated": 0}),
                         model=allocator_trace.model_growth(trace, 50 * MiB)), "x")
    assert "given this step's own requests grows its cache by 360.0 MiB; the GPU's grew by 360.0 MiB" in text
    failed = markdown(dict(analyse(trace, {"reserved": 50 * MiB, "allocated": 0}), model={"error": "boom"}), "x")
    assert "The allocator model failed on this trace: boom" in failed and "| reserved |" in failed


def test_the_compact_events_file_gives_the_same_analysis(tmp_path):
    trace, baseline = _trace(), {"reserved": 100 * MiB, "allocated": 60 * MiB}
    path = tmp_path / "allocator_trace_events.json.gz"
    allocator_trace.write_compact(path, allocator_trace.compact(trace), baseline)
    back, read_baseline = allocator_trace.read_compact(path)
    assert read_baseline == baseline and len(back) == len(trace)
    assert analyse(back, baseline) == analyse(trace, baseline)
    assert allocator_trace.model_growth(back, baseline["reserved"]) == \
        allocator_trace.model_growth(trace, baseline["reserved"])


def test_a_written_trace_is_reported_again_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "allocator_trace_events.json.gz"
    baseline = {"reserved": 100 * MiB, "allocated": 60 * MiB}
    allocator_trace.write_compact(path, allocator_trace.compact(_trace()), baseline)
    assert allocator_trace.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "| reserved | 170.0 |" in text and "the GPU's grew by 70.0 MiB" in text


def test_gpu_check_writes_the_report_and_the_events_and_keeps_the_events_out_of_its_json(tmp_path):
    """What bench/measure.py's traced step returns, as gpu-check files it: allocator_trace.md with the model's line,
    the events in allocator_trace_events.json.gz, and a record small enough for gpu-check.json."""
    import torch

    from tightrope.bench.gpu_check import _write_trace
    from tightrope.bench.gpu_run import Run

    trace, baseline = _trace(), {"reserved": 100 * MiB, "allocated": 60 * MiB}
    result = dict(analyse(trace, baseline), truncated=False, model=allocator_trace.model_growth(trace, 100 * MiB),
                  compact=allocator_trace.compact(trace))
    record = {"label": "off1.00/d0", "resolution": 2048, "batch": 1, "allocator_trace": result}
    _write_trace(Run("gpu-check", torch.device("cpu"), True, tmp_path, print), record)
    assert "compact" not in record["allocator_trace"]
    assert "the GPU's grew by 70.0 MiB" in (tmp_path / "allocator_trace.md").read_text()
    back, read_baseline = allocator_trace.read_compact(tmp_path / "allocator_trace_events.json.gz")
    assert analyse(back, read_baseline) == analyse(trace, baseline)
