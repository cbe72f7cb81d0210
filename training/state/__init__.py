"""Saved state: the resume file, crash-safe writes and output names, the lock on a state file."""
