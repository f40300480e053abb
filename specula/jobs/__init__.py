"""JSONL jobs: the one reader of request files, the answers file that survives a stop, and Ray Data jobs."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
