"""vLLM's stream_interval: several tokens of a choice per streamed chunk (pure)."""

# baton: pure

from __future__ import annotations


class Merged:
    """One choice's tokens waiting for their chunk under vLLM's stream_interval: the first
    token goes alone, then every `interval` tokens, and the last at once."""

    __slots__ = ("interval", "ids", "text", "prompt", "sent")

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.ids: list[int] = []
        self.text = ""
        self.prompt: list[int] | None = None
        self.sent = False

    def take(
        self, text: str, ids: list[int], prompt: list[int] | None, last: bool
    ) -> tuple[str, list[int], list[int] | None]:
        """This token added: the chunk to send now, or no ids while it waits."""
        self.ids.extend(ids)
        self.text += text
        self.prompt = self.prompt or prompt
        if self.sent and not last and len(self.ids) < self.interval:
            return "", [], None
        out = self.text, self.ids, self.prompt
        self.ids, self.text, self.prompt, self.sent = [], "", None, True
        return out
