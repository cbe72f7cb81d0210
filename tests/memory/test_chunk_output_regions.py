"""A checkpointed block's recompute skips its output chunks (ChunkContext.run_output) only when it is that block's
own checkpoint recomputing it: a model that checkpoints a group of blocks itself recomputes them in backward through
their forwards, and there each block's output feeds the next block, so it must be computed."""
import types

import torch
from equivalence import assert_equivalent
from torch.utils.checkpoint import checkpoint
from two_stream import make_lora_model, train_steps

from tightrope.memory import runtime as runtime_module
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy

CHUNKED = Strategy.of(compute_dtype="fp32", offload_fraction=1.0, checkpoint="all", token_chunks=3)


def group_checkpointed_forward(self, img, txt, vec):
    """TwoStream.forward with its double blocks run as one group under the model's own checkpoint."""
    img, txt, vec, pe = self.embed(img, txt, vec)

    def doubles(img, txt):
        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe)
        return img, txt
    img, txt = checkpoint(doubles, img, txt, use_reentrant=False)
    x = torch.cat([txt, img], 1)
    for block in self.single_blocks:
        x = block(x, vec=vec, pe=pe)
    return self.out(x[:, txt.shape[1]:])


def test_blocks_inside_the_models_own_checkpoint_compute_their_outputs_when_it_recomputes(monkeypatch):
    stand_ins = []
    real = runtime_module.stand_in
    monkeypatch.setattr(runtime_module, "stand_in", lambda *a: stand_ins.append(1) or real(*a))
    model = make_lora_model()
    model.forward = types.MethodType(group_checkpointed_forward, model)
    with MemoryRuntime(model, CHUNKED, "cpu", poison_slots=True, activation_min_bytes=0) as rt:
        losses, grads = train_steps(model, steps=2, runtime=rt)
    # the same training as plain PyTorch (the model's checkpoint changes no value); skipping an output chunk in the
    # group's recompute would feed a stand-in to the next block: wrong gradients
    assert_equivalent((losses, grads))
    assert stand_ins  # the blocks' own checkpoints (the single blocks, and the doubles' own) still skip
