"""OpenAI's request shapes that both ``specula.generate`` and request files take (no torch: the command line checks
files with it before torch is imported)."""

from __future__ import annotations


def prediction_content(prediction: object) -> object:
    """The content of OpenAI's prediction shape ``{"type": "content", "content": text or [{"type": "text", "text":
    ...}]}`` (a ``TypeError`` saying what is wrong with another dict); anything else as it is.

    >>> prediction_content({"type": "content",
    ...                     "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    'ab'
    """
    if not isinstance(prediction, dict):
        return prediction
    if prediction.get("type") != "content" or "content" not in prediction:
        raise TypeError(
            f'a prediction given as an object must be OpenAI\'s {{"type": "content", "content": ...}}, '
            f"got keys {sorted(prediction)}"
        )
    content = prediction["content"]
    if isinstance(content, list):  # text parts
        if not all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content
        ):
            raise TypeError('a prediction\'s "content" list must hold {"type": "text", "text": ...} parts')
        return "".join(part["text"] for part in content)
    return content
