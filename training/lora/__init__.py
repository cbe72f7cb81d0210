"""LoRA: settings and peft layers in a transformer, target presets, LoRA files, rescue of an unsaved LoRA."""
