"""The seam check: the new backend's first tokens and text against the overlap the client
already has (SeamCheck), and the text of a resume whose prompt ends mid-character, derived
from ids (HeldText)."""

# baton: pure

from __future__ import annotations

from baton.model import Seam
from dataplane.relay.progress import Held
from dataplane.relay.resume.detok import whole


class SeamCheck:
    """Compares the new backend's first tokens with the overlap the client already has.
    feed() returns what to send once verified (the part after the overlap), None while
    still deciding; `verdict` is DIVERGENT when the new backend disagrees."""

    def __init__(self, overlap_ids: tuple[int, ...], overlap_text: str) -> None:
        self._want = overlap_ids
        self._text_want = overlap_text
        self._ids: list[int] = []
        self._text: list[str] = []
        self.verdict: Seam | None = None if overlap_ids or overlap_text else Seam.UNCHECKED

    def feed(self, ids: list[int], text: str, finished: bool) -> tuple[list[int], str] | None:
        if self.verdict is not None:
            return ids, text
        self._ids.extend(ids)
        self._text.append(text)
        got = self._ids[: len(self._want)]
        if got != list(self._want[: len(got)]):
            self.verdict = Seam.DIVERGENT
            return None
        joined = "".join(self._text)
        if not self._text_want.startswith(joined[: len(self._text_want)]):
            self.verdict = Seam.DIVERGENT  # already other text: no need to wait for the rest
            return None
        if len(self._ids) < len(self._want) or len(joined) < len(self._text_want):
            if finished:  # ended inside the overlap: the old backend had gone on
                self.verdict = Seam.DIVERGENT
            return None
        if not joined.startswith(self._text_want):
            self.verdict = Seam.DIVERGENT
            return None
        self.verdict = Seam.VERIFIED
        return self._ids[len(self._want) :], joined[len(self._text_want) :]

def judge_fields(seam: Seam | None, agreed_before: bool, agreed_after: bool) -> Seam | None:
    """A reasoning stream's seam verdict judged on what the client assembled: DIVERGENT
    unless its reasoning and content, at the seam (`agreed_before`) and after the resume,
    are the split of the text by the think tags' ids (Stitcher.fields_agree). Ids and
    overlap text that match prove the new backend agrees with the old one, not that the
    client was given the right fields."""
    if agreed_before and agreed_after:
        return seam
    return Seam.DIVERGENT


class HeldText:
    """The text of a resume whose prompt ends past the client's last known character
    boundary (ResumePlan.held). The caller decodes `ids` with the new engine's tokenizer
    whenever the engine says it released text (it does so only at whole characters) and
    feeds the result to resolve(); from the first resolved release on, the engine's own text
    is right again (its detokenizer restarted at a character boundary)."""

    def __init__(self, held: Held) -> None:
        self.ids = list(held.ids)
        self._sent = held.sent
        self.verdict: Seam | None = None  # DIVERGENT: the decoded text is not the client's

    def add(self, ids: list[int]) -> None:
        self.ids.extend(ids)

    def resolve(self, decoded: str, finished: bool) -> str | None:
        """What the client lacks, from decoded = decode(ids): None while that ends inside a
        character (a byte-level engine releases nothing then either). At the end the caller
        passes the text up to the last character boundary (the rest is never released)."""
        if not (finished or whole(decoded)):
            return None
        if not decoded.startswith(self._sent):
            # The new engine decodes the client's tokens to other text (another tokenizer):
            # what follows cannot continue the client's text faithfully.
            self.verdict = Seam.DIVERGENT
        return decoded[len(self._sent) :]
