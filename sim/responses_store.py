"""The sim's Responses store: finished responses kept in memory, bounded (pure).

vLLM keeps them (with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) in a plain dict that
never forgets; the sim keeps the most recently stored or read ``capacity`` of them
(LRU), so a long benchmark cannot grow it without bound. A response is stored when
it finishes (streamed or not) with the messages it was generated from, which a
``previous_response_id`` follow-up inherits. A disabled store (capacity 0) holds
nothing, as vLLM without the variable: ``store`` is then ignored.
"""

# baton: pure

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sim.chat_template import Message

DEFAULT_CAPACITY = 4096


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    messages: tuple[Message, ...]


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = max(0, capacity)
        self._items: OrderedDict[str, Stored] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], messages: tuple[Message, ...]) -> None:
        if not self.enabled:
            return
        rid = response["id"]
        self._items[rid] = Stored(response, messages)
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        found = self._items.get(response_id)
        if found is not None:
            self._items.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
