"""The offloading runtime: plain PyTorch, model-agnostic, never imports ComfyUI."""
