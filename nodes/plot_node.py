"""Plots node: the loss curve and the memory/transfer chart, previewed on the node."""
from __future__ import annotations

from ..training.state.atomic_write import next_free_path
from ..training.input_checks import check_output_target
from ..training.charts import image_to_comfy, loss_chart, memory_chart
from . import host
from .input_validation import validation_result


class TightropePlots:
    DESCRIPTION = ("Loss curve (with the validation loss when the session has one) and per-step memory / transfer "
                   "chart of a training session, as images.")
    CATEGORY = "Tightrope/train"
    RETURN_TYPES = ("IMAGE", "IMAGE")
    RETURN_NAMES = ("loss_curve", "memory_chart")
    FUNCTION = "plot"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "session": ("TIGHTROPE_SESSION", {"tooltip": "The session to chart (from a Train node)."}),
            "filename_prefix": ("STRING", {"default": "tightrope/plot",
                                           "tooltip": "Name of the PNG files written for the preview."}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Before any training: the file name is safe and the preview folder can be written."""
        prefix = inputs.get("filename_prefix")
        return validation_result(cls, inputs,
                                 lambda: prefix is None or check_output_target(host.preview_dir()[0], prefix))

    def plot(self, session, filename_prefix):
        folder, kind = host.preview_dir()
        images, previews = [], []
        for name, chart in (("loss", loss_chart(session)), ("memory", memory_chart(session))):
            path = next_free_path(folder, f"{filename_prefix}_{name}", ext=".png")
            chart.save(path)
            images.append(image_to_comfy(chart))
            previews.append({"filename": path.name, "subfolder": str(path.parent.relative_to(folder)),
                             "type": kind})
        return {"ui": {"images": previews}, "result": tuple(images)}
