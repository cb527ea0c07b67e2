"""The conversation as the next turn will send it back, in token ids: this turn's messages plus the reply,
rendered as an *earlier* message of a longer conversation.

Rendering the reply as the last message gives a token sequence no next turn sends whenever a template
renders a message differently depending on what follows it: Qwen3 and Qwen3.5 keep the `<think>` block
only for assistant messages after the last user query, Llama 3.1 trims content, templates re-render tool
calls. So the reply is rendered with a message after it, twice, with two different texts; the two
renders agree up to that message's text, and the history ends just before the last special token they
share, the one that opens the next message (the tokenizer splits text at special tokens, so the ids
before one do not depend on what follows it: the next turn's ids agree up to there, whatever its
message says). For ChatML that is the render of the messages without a generation prompt. The follower is a user
message, and also a tool result when the reply called tools (templates render those under another header); the cut is
the shorter of the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..cache.policy import first_difference

RenderMany = Callable[[Sequence[tuple[list[dict], bool]]], list]

_PROBES = ("A", "B")


def special_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokens the tokenizer never merges with text around them (special added tokens)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(tok, "special", False))
    return frozenset(ids)


def _follower(reply: dict) -> dict:
    if reply.get("tool_calls"):
        return {"role": "tool", "tool_call_id": reply["tool_calls"][0].get("id") or "call"}
    return {"role": "user"}


def history_ids(messages: list[dict], render_many: RenderMany, specials: frozenset[int]) -> list[int]:
    """Ids of `messages` (ending with this turn's reply) as a prefix of the next turn's prompt. Raises
    ValueError where the template gives no such prefix (then nothing may be built from it), or the
    template's own error."""
    return prefix_before(messages, _follower(messages[-1]), render_many, specials)


def prefix_before(messages: list[dict], follower: dict, render_many: RenderMany, specials: frozenset[int]) -> list[int]:
    """Ids of `messages` as every longer conversation whose next message is a `follower` (a role and its
    fields; the probe texts are its content) starts. Also what a template that cannot render `messages`
    alone gives them (Qwen3.5's raises "No user query found" for a system message alone)."""
    first, second = render_many([(messages + [{**follower, "content": text}], False) for text in _PROBES])
    for r in (first, second):
        if isinstance(r, Exception):
            raise r
    shared = first_difference(first, second)
    cut = next((i for i in range(shared - 1, -1, -1) if first[i] in specials), 0)
    if cut == 0:
        raise ValueError("the template renders no special token before the next message")
    return list(first[:cut])
