"""delta_jax: RL from verifiable rewards for LLMs in JAX/Flax, with DelTA token credit assignment."""

__version__ = "0.1.0"
