"""Training pipeline: the step loop, its settings and objective at the top; data/, lora/, models/ and state/ below."""
