"""The embedded demo: a tiny random Flux, stand-in encoders and a generated dataset (no download)."""
