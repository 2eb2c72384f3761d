"""Installed as the package `mtpkit.recipes` (see pyproject's package-dir) so the YAML files ship with mtpkit.

A regular package rather than a bare folder: setuptools' editable installs find a package mapped to
another folder only by its __init__.py.
"""
