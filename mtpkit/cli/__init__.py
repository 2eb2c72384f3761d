"""The `mtp-convert` command line; the only package that prints."""
