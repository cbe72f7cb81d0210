"""ComfyUI node classes (classic V1 API). Each node is its schema plus one call into the runtime."""
from .dataset_nodes import TightropeDatasetFromLatents, TightropeLoadDataset
from .demo_nodes import TightropeDemoConditioning, TightropeDemoEncoders, TightropeDemoImages, TightropeDemoModel
from .lora_node import TightropeLoraSetup
from .plot_node import TightropePlots
from .save_node import TightropeSaveLora
from .strategy_node import TightropeMemoryStrategy
from .train_node import TightropeTrain

NODE_CLASS_MAPPINGS = {
    "TightropeDemoModel": TightropeDemoModel,
    "TightropeDemoEncoders": TightropeDemoEncoders,
    "TightropeDemoImages": TightropeDemoImages,
    "TightropeDemoConditioning": TightropeDemoConditioning,
    "TightropeLoadDataset": TightropeLoadDataset,
    "TightropeDatasetFromLatents": TightropeDatasetFromLatents,
    "TightropeLoraSetup": TightropeLoraSetup,
    "TightropeMemoryStrategy": TightropeMemoryStrategy,
    "TightropeTrain": TightropeTrain,
    "TightropeSaveLora": TightropeSaveLora,
    "TightropePlots": TightropePlots,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "TightropeDemoModel": "Demo Model (tiny Flux)",
    "TightropeDemoEncoders": "Demo Encoders (stand-in VAE + text)",
    "TightropeDemoImages": "Demo Images (generated shapes)",
    "TightropeDemoConditioning": "Demo Conditioning (stand-in text, any model)",
    "TightropeLoadDataset": "Load Dataset (images + captions)",
    "TightropeDatasetFromLatents": "Dataset from Latents + Conditioning",
    "TightropeLoraSetup": "LoRA Setup",
    "TightropeMemoryStrategy": "Memory Strategy",
    "TightropeTrain": "Train LoRA (steps)",
    "TightropeSaveLora": "Save LoRA",
    "TightropePlots": "Training Plots",
}
