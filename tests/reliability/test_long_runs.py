"""What grows with the length of a run stays out of the places with a size limit: the training state file's
history (a loss and a stats record per step, ~290 bytes a step as JSON) is in its body, not its safetensors header,
which safetensors refuses over 100 MB: with the history there, every save of a session past ~350,000 steps (chained
Train nodes add up) failed with `SafetensorError: header too large`, and every save wrote it again."""
import json
import math
import struct

import torch
from demo_setup import demo_session
from safetensors.torch import save_file

from tightrope.training.state.resume import load_state, resume_session, state_path
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def _history(steps: int) -> dict:
    """A session's history of `steps` steps, as a CUDA run records it (byte counts of a big GPU)."""
    stats = tuple({"step_time_s": 1.25 + i / 1e6, "peak_allocated_bytes": 23_000_000_000 + i,
                   "peak_reserved_bytes": 24_000_000_000 + i, "device_used_bytes": 25_000_000_000 + i,
                   "h2d_bytes": 31_000_000_000 + i, "d2h_bytes": 1_000_000 + i, "transfer_wait_s": 0.0125,
                   "recompiles": 0} for i in range(steps))
    return {"step": steps, "losses": tuple(0.5 + i / 1e7 for i in range(steps)), "stats": stats,
            "saved": tuple(f"/models/loras/run/lora_{i:05d}_.safetensors" for i in range(steps // 100)),
            "validation_losses": tuple((i, 0.25) for i in range(0, steps, 100))}


def test_the_state_file_header_does_not_grow_with_the_steps_trained(tmp_path):
    session = demo_session(tmp_path)
    headers = {}
    for steps in (0, 20_000):  # 20,000 steps of history were 5.8 MB of header; 350,000 reached safetensors' limit
        save = SaveTarget(tmp_path / f"out{steps}", "run", every=1)
        train(session.advanced(**_history(steps)), 1, device=CPU, save=save)
        headers[steps] = _header_bytes(state_path(save.folder, save.filename_prefix))
    assert headers[20_000] - headers[0] < 64, headers  # only the history tensor's offsets have more digits


def test_the_history_is_resumed_as_it_was_saved(tmp_path):
    session = demo_session(tmp_path).advanced(**_history(300))
    session = session.advanced(losses=session.losses[:-1] + (math.nan,))  # on_nonfinite='skip' records a NaN loss
    save = SaveTarget(tmp_path / "out", "run", every=1)
    trained = train(session, 2, device=CPU, save=save)
    resumed, state = resume_session(state_path(save.folder, save.filename_prefix), session)
    assert resumed.step == trained.step == 302
    assert len(resumed.losses) == 302 and math.isnan(resumed.losses[299])
    assert resumed.losses[:299] == trained.losses[:299] and resumed.losses[300:] == trained.losses[300:]
    assert resumed.stats == trained.stats and resumed.saved == trained.saved
    assert resumed.validation_losses == trained.validation_losses
    assert set(state.lora_state) == set(trained.lora_state)  # the history is not taken for a LoRA or optimizer tensor


def test_a_state_file_with_the_history_in_its_header_still_resumes(tmp_path):
    """Files written before the history moved out of the header (format v1) go on as before."""
    session = demo_session(tmp_path)
    save = SaveTarget(tmp_path / "out", "run", every=1)
    trained = train(session, 2, device=CPU, save=save)
    path = state_path(save.folder, save.filename_prefix)
    state = load_state(path)
    tensors = {f"lora.{k}": v for k, v in state.lora_state.items()}
    tensors |= {f"optimizer.{i}.{k}": v for i, entry in state.optimizer_state["state"].items()
                for k, v in entry.items() if isinstance(v, torch.Tensor)}
    save_file(tensors, str(path), {"format": "tightrope-training-state-v1",
                                   "tightrope.resume_state": json.dumps(state.info)})  # info holds the history
    resumed, _ = resume_session(path, session)
    assert resumed.step == 2 and resumed.losses == trained.losses and resumed.stats == trained.stats
    assert all(torch.equal(resumed.lora_state[k], v) for k, v in trained.lora_state.items())


def test_saving_a_growing_history_creates_no_new_ctypes_type_per_save(tmp_path):
    """safetensors writes each tensor through a ctypes array type of its byte length, which ctypes keeps for good
    (5.7 KB each): a history tensor of a new length at every save grew a long run by one type per save."""
    import gc

    from tightrope.training.state.resume import save_state
    session = demo_session(tmp_path)
    trained = train(session, 1, device=CPU)

    def array_types() -> int:
        gc.collect()
        return sum(1 for t in gc.get_objects() if type(t).__name__ == "PyCArrayType")
    before = array_types()
    for steps in range(1000, 1100):  # 100 saves, one step more each: the history grows from 290 to 320 KB
        history = _history(steps)
        save_state(tmp_path / "run.state.safetensors", trained, step=steps + 1, run_start=0, run_end=steps + 1,
                   lora_state=trained.lora_state, optimizer_state=trained.optimizer_state, losses=history["losses"],
                   stats=history["stats"], saved=history["saved"], fingerprints={},
                   validation=history["validation_losses"])
    assert array_types() - before <= 2  # 8 lengths per doubling: 288 and 320 KiB (it was one per save)
    assert load_state(tmp_path / "run.state.safetensors").info["losses"] == list(history["losses"])
