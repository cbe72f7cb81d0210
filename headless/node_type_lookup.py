"""Turning a workflow's node type name into a node class, and explaining why one isn't there.

Headless runs have Tightrope's nodes, plus ComfyUI's core and comfy_extras nodes when ComfyUI is loaded as a library
(`--comfyui DIR` / COMFYUI_DIR; headless/comfyui_library.py). A workflow using ComfyUI's own nodes (a loader, a sampler)
without it gets a message naming that option instead of a bare "unknown node"; nodes of other packs need ComfyUI.
"""
from __future__ import annotations

import difflib

from .graph import describe_node

# ComfyUI core node types people most often mix into a training workflow (nodes.py plus the training,
# sampling and primitive extras). Not exhaustive: UI-format files also say `cnr_id: "comfy-core"`.
KNOWN_CORE_NODE_TYPES = frozenset("""
KSampler KSamplerAdvanced CheckpointLoaderSimple CheckpointLoader CLIPTextEncode CLIPSetLastLayer VAEDecode VAEEncode
VAEEncodeForInpaint VAELoader EmptyLatentImage LatentUpscale LatentUpscaleBy LatentFromBatch RepeatLatentBatch SaveImage
PreviewImage LoadImage LoadImageMask LoadImageOutput ImageScale ImageScaleBy ImageInvert ImageBatch ImagePadForOutpaint
EmptyImage ConditioningAverage ConditioningCombine ConditioningConcat ConditioningMultiply ConditioningSetArea
ConditioningSetAreaPercentage ConditioningSetAreaStrength ConditioningSetMask SetLatentNoiseMask LatentComposite
LatentBlend LatentRotate LatentFlip LatentCrop LoraLoader LoraLoaderModelOnly CLIPLoader UNETLoader DualCLIPLoader
CLIPVisionEncode CLIPVisionLoader StyleModelApply StyleModelLoader unCLIPConditioning unCLIPCheckpointLoader
ControlNetApply ControlNetApplyAdvanced ControlNetLoader DiffControlNetLoader VAEDecodeTiled VAEEncodeTiled GLIGENLoader
GLIGENTextBoxApply InpaintModelConditioning DiffusersLoader LoadLatent SaveLatent ConditioningZeroOut
ConditioningSetTimestepRange TrainLoraNode LoraModelLoader SaveLoRA LossGraphNode LoadImageDataSetFromFolder
LoadImageTextDataSetFromFolder MakeTrainingDataset SaveTrainingDataset LoadTrainingDataset ResolutionBucket
SamplerCustom SamplerCustomAdvanced BasicScheduler BasicGuider CFGGuider KSamplerSelect RandomNoise DisableNoise
CLIPTextEncodeFlux FluxGuidance EmptySD3LatentImage ModelSamplingFlux ModelSamplingSD3 ModelSamplingAuraFlow
PrimitiveString PrimitiveStringMultiline PrimitiveInt PrimitiveFloat PrimitiveBoolean PreviewAny
""".split())
CORE_PACKAGE_ID = "comfy-core"  # the `properties.cnr_id` the frontend stamps on core nodes
CORE_MARKER_NODE = "KSampler"  # in the node mappings: ComfyUI's core nodes are loaded


def unknown_node_type_problem(node_id: str, class_type: str, node_mappings: dict, *, package: str | None = None) -> str:
    """The message for a node type that `node_mappings` lacks; `package` is the UI format's `cnr_id`, if any."""
    node = describe_node(node_id, class_type)
    inside_comfyui = "run this workflow inside ComfyUI (load it in the UI, or POST it to /prompt)"
    core_loaded = CORE_MARKER_NODE in node_mappings
    if not core_loaded and (package == CORE_PACKAGE_ID or (package is None and class_type in KNOWN_CORE_NODE_TYPES)):
        return (f"{node} is a ComfyUI core node, not a Tightrope node: run it with ComfyUI's nodes: pass --comfyui "
                f"DIR (or set COMFYUI_DIR) to your ComfyUI folder, in the python ComfyUI runs in; or {inside_comfyui}")
    if package == CORE_PACKAGE_ID:
        return (f"{node} is not among the core nodes of the loaded ComfyUI: update ComfyUI (the workflow was saved "
                f"by a newer one), or {inside_comfyui}")
    if package:
        loaded = "Tightrope or ComfyUI's core" if core_loaded else "Tightrope"
        return (f"{node} comes from the '{package}' node pack, not {loaded}: headless runs load no other packs; "
                f"{inside_comfyui} with that pack installed")
    close = difflib.get_close_matches(class_type, list(node_mappings), n=1, cutoff=0.8)
    if close:
        return f"{node} is not a Tightrope node type: did you mean '{close[0]}'? Fix the type name in the workflow"
    names = sorted(node_mappings)
    known = ", ".join(names[:30]) + (f", ... ({len(names)} in all)" if len(names) > 30 else "") or "none loaded"
    return (f"{node} is not a Tightrope node type (Tightrope's: {known}): if it comes from ComfyUI or another "
            f"node pack, {inside_comfyui}; otherwise fix the type name")
