"""kspec: declarative kernel specs compiled to fused kernels for Hopper and Blackwell.

    kspec.reference(spec, kernel=None)   numpy callables (the semantics; no GPU needed)
    kspec.load(artifact_dir)             compiled kernels as Python callables (cuda-python launch)

Importing kspec is cheap: the compiler, the runtime and the backends load on first use.
"""
__version__ = "0.1.0"

# pyproject.toml maps the checkout's top-level folders (spec_lang, compiler, backends, specs) under
# `kspec`.  When this file is imported from a source checkout (a git worktree, `bench/` scripts, a GPU
# machine with nothing installed), resolve those subpackages from the same checkout: otherwise an
# editable install of another checkout would supply them and mix two trees.
def _checkout_root():
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    return str(root) if (root / "pyproject.toml").is_file() and (root / "backends").is_dir() else None


_root = _checkout_root()
if _root and _root not in __path__:
    __path__.append(_root)
del _root

from kspec.core import KspecError, KspecInternalError, KspecRuntimeError  # noqa: E402


def load(path, *args, **kwargs):
    """Load a compiled artifact directory (see `kspec.runtime.load`)."""
    from kspec.runtime import load as _load
    return _load(path, *args, **kwargs)


def reference(spec, *args, **kwargs):
    """numpy callables for a spec (see `kspec.backends.reference.reference`)."""
    from kspec.backends.reference import reference as _reference
    return _reference(spec, *args, **kwargs)


__all__ = ["KspecError", "KspecInternalError", "KspecRuntimeError", "__version__", "load", "reference"]
