"""A workflow saved in ComfyUI on Windows runs headless on Linux (a cloud GPU), and one saved on Linux runs on Windows:
ComfyUI lists a model file in a subfolder as 'flux\\flux1-dev.safetensors' on Windows and 'flux/flux1-dev.safetensors'
elsewhere, and a workflow keeps the name as listed where it was saved. Before, headless validation refused it ("is
'flux\\flux1-dev.safetensors', not one of its choices")."""
import pytest

from tightrope.headless.input_spec import InputSpec, checked_value

LINUX = ("ae.safetensors", "flux/flux1-dev.safetensors", "flux/schnell/flux1-schnell.safetensors")
WINDOWS = tuple(c.replace("/", "\\") for c in LINUX)


@pytest.mark.parametrize("choices, saved, runs", [
    (LINUX, "flux\\flux1-dev.safetensors", "flux/flux1-dev.safetensors"),
    (LINUX, "flux\\schnell\\flux1-schnell.safetensors", "flux/schnell/flux1-schnell.safetensors"),
    (WINDOWS, "flux/flux1-dev.safetensors", "flux\\flux1-dev.safetensors"),
    (LINUX, "flux/flux1-dev.safetensors", "flux/flux1-dev.safetensors"),
    (LINUX, "ae.safetensors", "ae.safetensors"),
])
def test_a_model_name_saved_on_another_os_finds_its_file(choices, saved, runs):
    assert checked_value(InputSpec("unet_name", "COMBO", True, {}, choices), saved) == runs


def test_a_name_in_no_folder_is_still_refused():
    spec = InputSpec("unet_name", "COMBO", True, {}, LINUX)
    with pytest.raises(ValueError, match=r"is 'other\\\\flux1-dev.safetensors', not one of its choices"):
        checked_value(spec, "other\\flux1-dev.safetensors")
    assert checked_value(InputSpec("mode", "COMBO", True, {}, None), "a/b", check_limits=False) == "a/b"
