"""Training pipeline: dataset, LoRA, loss, step loop, save, model adapters."""
