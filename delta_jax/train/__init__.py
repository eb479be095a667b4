"""Training: pure train step, the RL loop, checkpoints, metrics."""

# A run directory's checkpoint folders (its layout: README "A run directory holds"): the RL
# steps' (run.Run.ckpt) and the SFT warm start's own (loop.sft_checkpointer). Here, where
# delta_jax.main reads them before anything heavy is imported.
CHECKPOINTS = "checkpoints"
SFT_CHECKPOINTS = "sft_checkpoints"
