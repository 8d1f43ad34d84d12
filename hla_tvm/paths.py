"""Checks of the file paths the package writes; torch-free (the runtime-only path uses them)."""
from __future__ import annotations

import os


def output_path(name, path):
    """`path` as a str: a file to write, checked before any work: not a folder, in a folder
    that exists and is writable."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a file path, got {type(path).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        raise TypeError(f"{name} must be a str or path, got bytes")
    if not path:
        raise ValueError(f"{name} must not be empty: give a file path")
    if os.path.isdir(path) or path.endswith(os.sep) or not os.path.basename(path):
        raise ValueError(f"{name} {path!r} is a folder: give a file path in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{name} {path}: the folder {folder} does not exist or is not writable")
    return path
