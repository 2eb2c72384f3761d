"""Plain PyTorch execution of a target + assistant pair; no file I/O."""
