"""Shared test set-up.

Eight simulated CPU devices for the whole session, so the sharding tests can build meshes; this
must happen before jax is first imported.
"""
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def shared_dir():
    """../shared beside the checkout (data sets, the Qwen3 tokenizer); skip when absent."""
    if not SHARED_DIR.is_dir():
        pytest.skip("../shared is not present beside the checkout")
    return SHARED_DIR


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(shared_dir):
    path = shared_dir / "tokenizers" / "qwen3"
    if not (path / "tokenizer.json").is_file():
        pytest.skip("../shared/tokenizers/qwen3 is not present")
    return path
