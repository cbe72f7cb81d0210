"""The nodes' VALIDATE_INPUTS, called the way ComfyUI 0.33 calls it at queue time (execution.validate_inputs): as a
classmethod, every input by name (**kwargs: ComfyUI then skips its own min/max/choice checks), linked inputs as None;
it answers True or a message naming the input and the fix."""
import math

import pytest
import torch

from tightrope import NODE_CLASS_MAPPINGS
from tightrope.headless.input_spec import node_input_specs
from tightrope.nodes import host

VALIDATED = ["TightropeTrain", "TightropeSaveLora", "TightropeLoraSetup", "TightropeMemoryStrategy",
             "TightropeLoadDataset", "TightropeDatasetFromLatents", "TightropePlots", "TightropeDemoImages"]


@pytest.fixture(autouse=True)
def out(tmp_path):
    with host.headless(tmp_path):
        yield tmp_path


def _queued(name: str, **changes) -> dict:
    """What ComfyUI passes for a node whose widgets hold their defaults and whose sockets are linked (None)."""
    specs = node_input_specs(NODE_CLASS_MAPPINGS[name])
    values = {n: (s.default if s.is_widget else None) for n, s in specs.items()}  # every socket linked
    values |= {"TightropeLoadDataset": {"folder": None}}.get(name, {})
    return values | changes


def _float_widgets():
    for name in VALIDATED:
        for input_name, spec in node_input_specs(NODE_CLASS_MAPPINGS[name]).items():
            if spec.type == "FLOAT":
                yield name, input_name


@pytest.mark.parametrize("name", sorted(NODE_CLASS_MAPPINGS))
def test_every_node_with_a_float_widget_validates_its_inputs_itself(name):
    """ComfyUI's own min/max check lets NaN through (NaN compares false), so such a node needs VALIDATE_INPUTS."""
    has_float = any(s.type == "FLOAT" for s in node_input_specs(NODE_CLASS_MAPPINGS[name]).values())
    assert not has_float or hasattr(NODE_CLASS_MAPPINGS[name], "VALIDATE_INPUTS")


@pytest.mark.parametrize("name", VALIDATED)
def test_defaults_with_linked_inputs_pass(name):
    assert NODE_CLASS_MAPPINGS[name].VALIDATE_INPUTS(**_queued(name)) is True


@pytest.mark.parametrize("name, input_name", list(_float_widgets()))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_every_float_widget_refuses_nan_and_inf(name, input_name, bad):
    verdict = NODE_CLASS_MAPPINGS[name].VALIDATE_INPUTS(**_queued(name, **{input_name: bad}))
    assert isinstance(verdict, str) and f"input '{input_name}' is {bad}, not a finite number: use a value in" in verdict


def test_ranges_and_choices_are_checked_since_comfyui_skips_them():
    lora = NODE_CLASS_MAPPINGS["TightropeLoraSetup"]
    assert "input 'rank' is 0, below its min of 1" in lora.VALIDATE_INPUTS(**_queued("TightropeLoraSetup", rank=0))
    assert "input 'targets' is 'attn', not one of its choices" in \
        lora.VALIDATE_INPUTS(**_queued("TightropeLoraSetup", targets="attn"))
    train = NODE_CLASS_MAPPINGS["TightropeTrain"]
    both = train.VALIDATE_INPUTS(**_queued("TightropeTrain", steps=0, learning_rate=2.0))
    assert "input 'steps' is 0, below its min of 1" in both and "input 'learning_rate' is 2.0, above its max" in both


def test_a_linked_value_is_left_to_the_node(out):
    save = NODE_CLASS_MAPPINGS["TightropeSaveLora"]
    assert save.VALIDATE_INPUTS(session=None, filename_prefix=None) is True
    assert "contains '..'" in save.VALIDATE_INPUTS(session=None, filename_prefix="a/../../b")


def test_node_checks(out, tmp_path):
    assert "does not exist" in NODE_CLASS_MAPPINGS["TightropeLoadDataset"].VALIDATE_INPUTS(
        **_queued("TightropeLoadDataset", folder=str(tmp_path / "nope")))
    assert "does not compile" in NODE_CLASS_MAPPINGS["TightropeLoraSetup"].VALIDATE_INPUTS(
        **_queued("TightropeLoraSetup", target_regex="(unclosed"))
    assert "was not found" in NODE_CLASS_MAPPINGS["TightropeLoraSetup"].VALIDATE_INPUTS(
        **_queued("TightropeLoraSetup", existing_lora="gone.safetensors"))
    strategy = NODE_CLASS_MAPPINGS["TightropeMemoryStrategy"]
    assert "weight_dtype='fp16' does not work with compute_dtype='fp32'" in strategy.VALIDATE_INPUTS(
        **_queued("TightropeMemoryStrategy", weight_dtype="fp16", compute_dtype="fp32"))
    assert "contains '..'" in NODE_CLASS_MAPPINGS["TightropePlots"].VALIDATE_INPUTS(session=None,
                                                                                  filename_prefix="../plots")
    # an existing_lora that is a model's weights, or of another rank: refused when queued (were found in Train)
    from safetensors.torch import save_file
    folder = host.loras_dir()
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"model.diffusion_model.x.weight": torch.zeros(4, 4)}, str(folder / "ckpt.safetensors"))
    save_file({"diffusion_model.x.lora_A.weight": torch.zeros(4, 8), "diffusion_model.x.lora_B.weight":
               torch.zeros(8, 4)}, str(folder / "r4.safetensors"))
    setup = NODE_CLASS_MAPPINGS["TightropeLoraSetup"]
    assert "existing_lora='ckpt.safetensors' (" in setup.VALIDATE_INPUTS(
        **_queued("TightropeLoraSetup", existing_lora="ckpt.safetensors"))
    assert "is not a LoRA file: none of its 1 tensors is an adapter weight (e.g. model.diffusion_model.x.weight" in \
        setup.VALIDATE_INPUTS(**_queued("TightropeLoraSetup", existing_lora="ckpt.safetensors"))
    assert "was trained with rank 4 but this LoRA setup has rank=16: set rank=4 to continue from it" in \
        setup.VALIDATE_INPUTS(**_queued("TightropeLoraSetup", existing_lora="r4.safetensors"))
    assert setup.VALIDATE_INPUTS(**_queued("TightropeLoraSetup", existing_lora="r4.safetensors", rank=4)) is True
    # a kohya file whose text-encoder part (which training drops) has another rank: the diffusion part's counts
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(16, 8), "lora_unet_x.lora_up.weight": torch.zeros(8, 16),
               "lora_te1_y.lora_down.weight": torch.zeros(4, 8), "lora_te1_y.lora_up.weight": torch.zeros(8, 4)},
              str(folder / "kohya.safetensors"))
    assert setup.VALIDATE_INPUTS(**_queued("TightropeLoraSetup", existing_lora="kohya.safetensors")) is True
    assert "was trained with rank 16 but this LoRA setup has rank=4" in setup.VALIDATE_INPUTS(
        **_queued("TightropeLoraSetup", existing_lora="kohya.safetensors", rank=4))
    # Demo Images' subfolder, named as itself (it was refused as 'filename_prefix', and only when the node ran)
    images = NODE_CLASS_MAPPINGS["TightropeDemoImages"]
    assert "subfolder='../../escape' contains '..': subfolders may only go down, e.g. 'tightrope_demo_images'" in \
        images.VALIDATE_INPUTS(**_queued("TightropeDemoImages", subfolder="../../escape"))
    assert "subfolder='/tmp/x' is an absolute path" in images.VALIDATE_INPUTS(
        **_queued("TightropeDemoImages", subfolder="/tmp/x"))
    assert images.VALIDATE_INPUTS(**_queued("TightropeDemoImages", subfolder="mine/imgs/")) is True  # a folder
    assert "subfolder='./' is the output folder itself: give a folder inside it, e.g. 'tightrope_demo_images'" in \
        images.VALIDATE_INPUTS(**_queued("TightropeDemoImages", subfolder="./"))
    assert "filename_prefix='.' ends in a folder, not a file name: add one, e.g. 'my_lora'" in \
        NODE_CLASS_MAPPINGS["TightropeSaveLora"].VALIDATE_INPUTS(session=None, filename_prefix=".")
    # auto mode ignores the manual fields, so it does not refuse them
    assert strategy.VALIDATE_INPUTS(**_queued("TightropeMemoryStrategy", mode="auto", weight_dtype="fp16",
                                              compute_dtype="fp32")) is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, so device='cuda' is valid here")
def test_cuda_without_cuda_is_refused_at_queue_time():
    verdict = NODE_CLASS_MAPPINGS["TightropeTrain"].VALIDATE_INPUTS(**_queued("TightropeTrain", device="cuda"))
    assert verdict == "device='cuda' but CUDA is not available: choose 'auto' or 'cpu'"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, where adamw8bit may run")
def test_an_optimizer_that_cannot_run_here_is_refused_at_queue_time():
    verdict = NODE_CLASS_MAPPINGS["TightropeTrain"].VALIDATE_INPUTS(**_queued("TightropeTrain", device="cpu",
                                                                             optimizer="adamw8bit"))
    assert verdict in ("optimizer='adamw8bit' runs on CUDA only: choose optimizer='adamw' on this device",
                       "optimizer='adamw8bit' needs the bitsandbytes package: `pip install bitsandbytes` into "
                       "ComfyUI's Python (CUDA only), or choose optimizer='adamw'")
