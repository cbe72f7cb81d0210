"""Model adapters: what the trainer needs from a model (protocol), the ComfyUI MODEL, the reference Flux."""
