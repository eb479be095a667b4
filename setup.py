"""delta_jax: RLVR for LLMs in JAX/Flax with DelTA token credit assignment."""
from setuptools import find_packages, setup

# The top-level kernels/ folder installs as `delta_jax.kernels`, so that the unrelated
# `kernels` distribution on PyPI can never shadow it; the other way round, where the repository's
# root is on sys.path, kernels/__init__.py hands the top-level name `kernels` to that
# distribution (transformers >= 5.25 requires and imports it).
packages = find_packages(include=["delta_jax", "delta_jax.*"])
packages += ["delta_jax.kernels"] + [
    "delta_jax.kernels." + p for p in find_packages(where="kernels")
]

setup(
    name="delta_jax",
    version="0.1.0",
    description="RL from verifiable rewards with DelTA token credit assignment, in JAX/Flax",
    python_requires=">=3.11",
    packages=packages,
    package_dir={"delta_jax.kernels": "kernels"},
    install_requires=[
        "jax>=0.6.0",
        "flax>=0.11.0",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11.0",
        "transformers>=4.51.0",  # Qwen3 support
        "safetensors>=0.4.0",
        "tokenizers>=0.21.0",
        # transformers' apply_chat_template (data.template "chat" and "code") needs it, and
        # transformers does not require it (found 2026-11-24 in a venv without torch).
        "jinja2>=3.1.0",
        "ml-collections>=1.0.0",
        "tensorflow-datasets>=4.9.7",
        "array-record>=0.7.0",
        "absl-py>=2.1.0",
        "math-verify[antlr4_13_2]>=0.7.0",
        "grain>=0.2.10",
        "tqdm>=4.66.0",
        "numpy>=1.26",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        "pyarrow>=15.0",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "pytest-xdist>=3.5",  # scripts/test.sh runs the files on two workers
            # CPU build used by the transformers parity tests.
            "torch==2.13.0",
            # Applies an exported LoRA adapter in the parity test (models.save_peft_adapter).
            "peft>=0.17",
        ],
    },
)
