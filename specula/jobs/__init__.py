"""JSONL jobs: the one reader of request files, the answers file that survives a stop, and Ray Data jobs."""

from .._modules import attribute


def __getattr__(name: str):
    return attribute(__name__, name)
