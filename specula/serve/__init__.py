"""``specula serve``: an OpenAI-compatible HTTP server (chat and text completions, streamed or whole, with predicted
outputs) whose requests share the target's passes through the loop, joining and leaving between passes."""

from .._lazy import submodules

__getattr__ = submodules(__name__)
