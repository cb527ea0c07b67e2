"""`<think>` blocks split from the answer, opened by the reply or by the prompt, on fixed outputs."""

import pytest

from hyserve.parsers.reasoning import ThinkParser

from .helpers import parsed, turn

CASES = [
    # (reply, the prompt opened <think>, content, reasoning)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Paris.", "Let me see."),
    ("Let me see.\n</think>\n\nParis.", True, "Paris.", "Let me see."),
    ("<think>\n\n</think>\n\nParis.", False, "Paris.", None),  # empty reasoning (enable_thinking off in Qwen3)
    ("Paris.", False, "Paris.", None),
    ("Still thinking when max_tokens ran out", True, "", "Still thinking when max_tokens ran out"),
    ("<think>\nunfinished", False, "", "unfinished"),
    ("The tag <think> inside an answer is text.", False, "The tag <think> inside an answer is text.", None),
    ("x </think> y", False, "x </think> y", None),  # a close without an open is not reasoning
    ("a</think>b</think>c", True, "b</think>c", "a"),
    ("<thin", False, "<thin", None),
    ("", True, "", None),
]


@pytest.mark.parametrize("text,opened,content,reasoning", CASES)
def test_think(text, opened, content, reasoning):
    assert parsed(turn(None, ThinkParser, opened=opened), text) == (content, reasoning, [])


@pytest.mark.parametrize(
    "tail,opened",
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3.5 with enable_thinking: false
        ("<|im_start|>assistant\n", False),
    ],
)
def test_prompt_opens_reasoning(tail, opened):
    assert ThinkParser.opened_by(tail) is opened
