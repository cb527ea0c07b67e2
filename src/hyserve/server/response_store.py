"""Stored responses (`store: true`): what `previous_response_id` continues from and `GET /v1/responses/{id}`
returns. Each is kept under its tenant (the API key's hash), so no tenant can read or continue another's;
all of them share one byte budget, the least recently used going first."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

TOKEN_BYTES = 8  # a Python int in a list, about


@dataclass
class StoredResponse:
    tokens: list[int]  # prompt + output, exactly as generated: the next turn starts from all of them
    response: dict  # the response object as returned
    instructions: str | None
    nbytes: int
    messages: list[dict] | None = None  # the conversation through the reply, as the template reads it
    tools: list[dict] | None = None  # the tools its prompt lists (chat form)


class ResponseStore:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(
        self,
        tenant: str,
        rid: str,
        tokens: list[int],
        response: dict,
        instructions: str | None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
    ) -> bool:
        """Keep a response; False when it alone is over the budget (it is then not stored)."""
        nbytes = TOKEN_BYTES * len(tokens) + len(json.dumps(response)) + len(instructions or "")
        nbytes += len(json.dumps([messages, tools], default=str))
        if nbytes > self.budget:
            return False
        with self._lock:
            self._drop((tenant, rid))
            while self._items and self.used + nbytes > self.budget:
                self._drop(next(iter(self._items)))
            self._items[(tenant, rid)] = StoredResponse(list(tokens), response, instructions, nbytes, messages, tools)
            self.used += nbytes
        return True

    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get((tenant, rid))
            if item is not None:
                self._items.move_to_end((tenant, rid))
            return item

    def delete(self, tenant: str, rid: str) -> bool:
        with self._lock:
            return self._drop((tenant, rid))

    def _drop(self, key) -> bool:
        item = self._items.pop(key, None)
        if item is not None:
            self.used -= item.nbytes
        return item is not None

    def __len__(self) -> int:
        return len(self._items)
