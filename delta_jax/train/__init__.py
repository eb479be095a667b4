"""Training: pure train step, the RL loop, checkpoints, metrics."""
