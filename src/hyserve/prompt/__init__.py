"""Prompt tokens: `tokens` (rendering a conversation to token ids, with its prefix encoder), `escape` (escaping
content that looks like a chat template's special tokens), `bound` (the prompt length bound) and `next_turn`
(the conversation as the next turn will send it back, in token ids)."""
