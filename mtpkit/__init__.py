"""mtpkit: make Gemma 4 target + assistant (MTP) pairs right before they reach a GPU, and run them."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mtpkit")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"
