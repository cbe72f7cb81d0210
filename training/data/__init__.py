"""Training data: image folders and their captions, aspect buckets, the encoders, the cached dataset."""
