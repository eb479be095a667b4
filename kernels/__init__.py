"""Kernels (installed as delta_jax.kernels): fused DelTA pass, chunked LM-head log-probs."""
