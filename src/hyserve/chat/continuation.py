"""The ids that continue a finished reply with new messages, without re-rendering what came before.

A stored response's tokens (prompt + reply, as generated) are the exact state the engine recorded after
its last token; the next turn is those tokens plus only what the template writes for the new messages.
The template renders the new messages after a placeholder turn that ends with a sentinel reply; everything
after the sentinel is the continuation: the end of the assistant turn (dropped when the reply already ended
with that end-of-turn token), the new messages and the generation prompt. The prefix the template writes
(a default system prompt, tool definitions) belongs to the stored prompt already and is cut off.
"""

from __future__ import annotations

from collections.abc import Sequence

SENTINEL = "hyserve-previous-reply-7c1e"
_BASE = [{"role": "user", "content": "hyserve-previous-turn"}, {"role": "assistant", "content": SENTINEL}]


class ContinuationError(ValueError):
    """The template cannot render the new messages as a continuation (a 400)."""


def continuation_ids(
    rt, messages: list[dict], previous: Sequence[int], salt: str = "", template_kwargs: dict | None = None
) -> list[int]:
    """Ids to append to `previous` (a finished reply's prompt + output) for `messages` and a generation
    prompt. Content is escaped as in every render (`prompt_escape`)."""
    escape = rt.escaper is not None and not rt.special_tokens_in_content
    kwargs = dict(template_kwargs or {})
    if escape:
        messages = rt.escaper.escape(messages)
        kwargs = dict(rt.escaper.escape_value(kwargs))
    try:
        text = rt.tokenizer.apply_chat_template(
            _BASE + list(messages), tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as exc:
        raise ContinuationError(f"could not apply the chat template: {exc}") from exc
    at = text.find(SENTINEL)
    if at < 0:
        raise ContinuationError(
            "the chat template does not render an earlier assistant reply verbatim, so a "
            "stored response cannot be continued on this model"
        )
    tail = text[at + len(SENTINEL) :]
    if previous and previous[-1] in rt.eos_token_ids:  # the reply ended its turn itself: do not end it twice
        end = rt.tokenizer.decode([previous[-1]], skip_special_tokens=False)
        if end and tail.startswith(end):
            tail = tail[len(end) :]
    if not tail:
        raise ContinuationError("the chat template renders nothing for the new input")
    return rt.prompt_encoder.encode(tail, salt, rt.max_model_len)
