"""mtpkit: make Gemma 4 target + assistant (MTP) pairs right before they reach a GPU, and run them."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mtpkit")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"


def __getattr__(name: str):
    # The loader pulls in torch and transformers; `import mtpkit` (and the CLI's start-up) should not.
    if name in ("load_pair", "load_target", "load_draft", "Pair", "Generation"):
        from mtpkit import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'mtpkit' has no attribute {name!r}")
