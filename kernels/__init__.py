"""Fused passes (installed as delta_jax.kernels): the DelTA pass over cached features and the
LM-head log-probs tiled over the vocabulary, both plain jnp compiled by XLA on every backend.

The Pallas (Triton) kernels that used to sit beside them were retired on 2026-11-23 (issue #16):
measured on an H100, neither beat XLA where it matters, and Pallas' Triton backend is deprecated
in jax 0.11. BENCHMARKS.md ("Kernel decisions") has the numbers. paged_decode is the project's
paged decode attention on the Mosaic GPU backend: rollout.decode_attention="auto" runs it on
Hopper GPUs (1.38x the whole decode of jax.experimental.pallas.ops' Triton paged attention on an
H200, 2026-11-26); that Triton kernel was retired on 2026-11-26 too, and other GPUs and problems
the Mosaic kernel refuses get the jnp page reader (delta_jax.models.attention.resolve_decode_impl).
"""
if __name__ == "delta_jax.kernels":
    from delta_jax.kernels.delta_pass import (
        DeltaPassSums,
        add_sums,
        delta_pass,
        masked_moments,
        merge_moments,
    )
    from delta_jax.kernels.lm_head_logprob import lm_head_logprob

    __all__ = [
        "DeltaPassSums",
        "add_sums",
        "delta_pass",
        "lm_head_logprob",
        "masked_moments",
        "merge_moments",
    ]
else:
    # Imported as the top-level `kernels`: Python found this folder because the repository's
    # root is on sys.path (python -m from the root, pytest), where it would shadow the `kernels`
    # distribution on PyPI (Hugging Face's kernel hub, which transformers >= 5.25 requires and
    # imports: `from kernels import CUDAProperties` failed here on 2026-12-03). That name is not
    # this project's (this folder is delta_jax.kernels), so it goes to the distribution.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:
        raise ModuleNotFoundError(
            f"No module named {__name__!r} (the repository's kernels/ folder is "
            "delta_jax.kernels)", name=__name__)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module  # the import statement returns what sys.modules holds
    _spec.loader.exec_module(_module)
