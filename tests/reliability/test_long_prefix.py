"""A filename_prefix too long for the files a run writes is refused when the workflow is queued, naming it; the
longest one allowed writes every file a run can write (LoRAs at every save, the EMA, the state file and its lock, a
rescued LoRA). Before, a 230-character prefix passed the queue check, trained, and then failed to save with
"File name too long" (the rescue copy too, its name holding the prefix), or failed the Train node with an OSError
traceback from the state file's lock (found driving a real ComfyUI server)."""
import errno
import os

import pytest
import torch
from demo_setup import demo_session

from tightrope.nodes import NODE_CLASS_MAPPINGS
from tightrope.training import training_run
from tightrope.training.lora.files import read_lora_file
from tightrope.training.lora.rescue import LoraNotSavedError
from tightrope.training.save_session import save_session_ema, save_session_lora
from tightrope.training.state import atomic_write
from tightrope.training.state.atomic_write import (PREFIX_NAME_MAX_BYTES, OutputPathError, safe_output_path,
                                                   user_output_path)

LONGEST = "tightrope/" + "é" * (PREFIX_NAME_MAX_BYTES // 2)  # 150 bytes in 75 characters: bytes count


@pytest.mark.parametrize("prefix, what", [
    ("a/" + "x" * (PREFIX_NAME_MAX_BYTES + 1), "its file name has 151 bytes, at most 150 fit"),
    (LONGEST + "x", "its file name has 151 bytes, at most 150 fit"),
    ("y" * 256 + "/lora", "a name in it has 256 bytes, more than the 255"),
])
def test_a_prefix_too_long_is_refused_at_queue_time(tmp_path, prefix, what):
    with pytest.raises(OutputPathError, match=f"is too long: {what}"):
        user_output_path(tmp_path, prefix)
    for node in ("TightropeSaveLora", "TightropePlots"):
        refusal = NODE_CLASS_MAPPINGS[node].VALIDATE_INPUTS(session=None, filename_prefix=prefix)
        assert isinstance(refusal, str) and what in refusal and "choose a shorter name" in refusal
    assert len(refusal) < 400  # the prefix is shown elided, not whole


def test_the_longest_prefix_writes_every_file_a_run_writes(tmp_path, monkeypatch):
    assert len(safe_output_path(tmp_path, LONGEST).name.encode()) == PREFIX_NAME_MAX_BYTES
    session = demo_session(tmp_path, ema_decay=0.9)
    loras = tmp_path / "loras"
    trained, _, _ = training_run.run_training_node(
        session.config, 2, session=None, model=session.model, dataset=session.dataset, lora=session.lora,
        strategy=session.strategy, device="cpu", save_dir=loras, filename_prefix=LONGEST, save_every=1,
        progress=None, should_stop=None, resume="same run", node_id="123456789:123456789:123456789")
    name = safe_output_path(loras, LONGEST).name
    folder = loras / "tightrope"
    written = sorted(p.name for p in folder.iterdir())
    state = f"{name}.node-123456789_123456789_123456789.state.safetensors"
    assert state in written and len(state.encode()) + len(".lock") <= 255
    assert f"{name}_00001_.safetensors" in written and f"{name}_00002_.safetensors" in written
    assert save_session_lora(trained, loras, LONGEST).name == f"{name}_00003_.safetensors"
    assert save_session_ema(trained, loras, LONGEST).name == f"{name}_ema_00001_.safetensors"

    real = atomic_write._create_temp

    def full_folder(path):  # the save folder is full: the rescue writes beside it, its name the longest of all
        if path.parent == folder:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path)
    monkeypatch.setattr(atomic_write, "_create_temp", full_folder)
    with pytest.raises(LoraNotSavedError, match="the trained LoRA was kept in") as e:
        save_session_lora(trained, loras, LONGEST)
    rescued = loras / f"tightrope_rescue_{name}_step2_00001_.safetensors"
    assert str(rescued) in str(e.value)
    tensors, meta = read_lora_file(rescued)
    assert meta["tightrope.steps"] == "2" and all(torch.is_tensor(t) for t in tensors.values())
