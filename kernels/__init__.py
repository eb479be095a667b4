"""Kernels (installed as delta_jax.kernels): fused DelTA pass, chunked LM-head log-probs.

Each kernel has a plain-jnp reference with the same signature and an `*_auto` entry point that
uses the Pallas (Triton) kernel on GPU and the reference elsewhere; override with the environment
variable DELTA_JAX_KERNELS=auto|pallas|interpret|reference or the impl= argument.
"""
from delta_jax.kernels.backend import ENV_VAR, resolve_impl
from delta_jax.kernels.delta_pass import (
    DeltaPassSums,
    add_sums,
    centroids_from_sums,
    delta_pass,
    delta_pass_auto,
    delta_pass_reference,
    margin_std_from_sums,
    masked_moments,
    merge_moments,
    reduce_moments,
)
from delta_jax.kernels.lm_head_logprob import (
    lm_head_logprob,
    lm_head_logprob_auto,
    lm_head_logprob_reference,
)

__all__ = [
    "ENV_VAR",
    "DeltaPassSums",
    "add_sums",
    "centroids_from_sums",
    "delta_pass",
    "delta_pass_auto",
    "delta_pass_reference",
    "lm_head_logprob",
    "lm_head_logprob_auto",
    "lm_head_logprob_reference",
    "margin_std_from_sums",
    "masked_moments",
    "merge_moments",
    "reduce_moments",
    "resolve_impl",
]
