"""OpenAI's deprecated `functions` in the reply: a request that sent `functions` gets its call back as the
message's `function_call` with finish_reason "function_call" (one call per reply), the form OpenAI answers
it in, and not as `tool_calls`, which a client of the legacy API does not read."""

from __future__ import annotations

from ..engine import Finished
from .formats import ChatFormat


def _legacy(message: dict) -> dict:
    """A message or stream delta with its `tool_calls` as `function_call` (the first call: there is one)."""
    if "tool_calls" not in message:
        return message
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    fn = message["tool_calls"][0]["function"]
    out["function_call"] = {k: fn[k] for k in ("name", "arguments") if k in fn}
    return out


def _reason(finish: str | None) -> str | None:
    return "function_call" if finish == "tool_calls" else finish


class LegacyFunctionsFormat(ChatFormat):
    def _chunk(
        self, delta: dict, finish: str | None = None, ids: list[int] | None = None, logprobs: dict | None = None
    ) -> dict:
        return super()._chunk(_legacy(delta), _reason(finish), ids, logprobs)

    def choice(self, fin: Finished) -> dict:
        choice = super().choice(fin)
        choice["message"], choice["finish_reason"] = _legacy(choice["message"]), _reason(choice["finish_reason"])
        return choice
