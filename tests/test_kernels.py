"""kernels/__init__.py: the repository's kernels/ folder is the package delta_jax.kernels. Where
the repository's root is on sys.path (python -m from the root, pytest) the folder is also found
under the top-level name `kernels`, which belongs to a distribution on PyPI (Hugging Face's kernel
hub, required and imported by transformers >= 5.25): imported under that name it hands the name to
the installed distribution, and is no module where none is installed."""
import importlib.metadata
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
OURS = REPO / "kernels" / "__init__.py"


def python(code: str, *flags: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter started in the repository's root ('' first on sys.path)."""
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_the_top_level_name_goes_to_another_package_of_that_name(tmp_path):
    """With another `kernels` later on sys.path (a stand-in for the PyPI distribution), `import
    kernels` from the root is that package, submodules included, and delta_jax.kernels' names are
    not in it; without one it is a ModuleNotFoundError that says what the folder is. (-S: no
    site-packages, so only these two candidates exist.)"""
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("CUDAProperties = 'hub'\n")
    (other / "layer.py").write_text("NAME = 'hub layer'\n")
    got = python(f"import sys; sys.path[1:1] = [{str(REPO)!r}, {str(tmp_path)!r}]\n"
                 "import kernels, kernels.layer\n"
                 "print(kernels.CUDAProperties, kernels.layer.NAME, hasattr(kernels, 'delta_pass'),"
                 " kernels.__file__, sep='|')", "-S")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip().split("|") == ["hub", "hub layer", "False",
                                             str(other / "__init__.py")]
    missing = python(f"import sys; sys.path.insert(1, {str(REPO)!r})\nimport kernels", "-S")
    assert missing.returncode == 1
    assert ("ModuleNotFoundError: No module named 'kernels' (the repository's kernels/ folder is "
            "delta_jax.kernels)") in missing.stderr


def test_this_environment_imports_the_installed_kernels_and_delta_jax_kernels():
    """The suite's own environment, from the root: `kernels` is the installed distribution where
    there is one (transformers' import of it works), delta_jax.kernels this folder either way."""
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    ours = python("import delta_jax.kernels as k; print(k.__file__, k.lm_head_logprob.__name__)")
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.split() == [str(OURS), "lm_head_logprob"]
    top = python("import kernels; print(kernels.__file__)")
    if installed:
        assert top.returncode == 0, top.stderr
        assert pathlib.Path(top.stdout.strip()) != OURS
    else:
        assert "No module named 'kernels'" in top.stderr
