"""Which parsers a served model uses: named on the command line, or ("auto") chosen from the text of its
chat template, which shows the format it asks the model to write."""

from __future__ import annotations

from dataclasses import dataclass

from .hermes import HermesParser
from .llama3_json import Llama3JsonParser
from .qwen3_xml import Qwen3XmlParser
from .reasoning import ThinkParser

# In detection order: the XML format's templates also contain `<tool_call>`.
TOOL_PARSERS = {p.name: p for p in (Qwen3XmlParser, HermesParser, Llama3JsonParser)}
TOOL_ALIASES = {"qwen3_coder": "qwen3_xml", "qwen3": "hermes", "granite": "hermes", "llama3": "llama3_json"}
REASONING_PARSERS = {p.name: p for p in (ThinkParser,)}
REASONING_ALIASES = {"qwen3": "think", "deepseek_r1": "think"}


@dataclass(frozen=True)
class Parsers:
    tool: type | None  # a ToolParser subclass
    reasoning: type | None  # ThinkParser
    single_tool_call: bool = False  # the template renders one call per assistant message (`chat.call_limit`)

    @property
    def names(self) -> dict[str, str | None]:
        return {
            "tool_call_parser": self.tool.name if self.tool else None,
            "reasoning_parser": self.reasoning.name if self.reasoning else None,
        }


def template_text(tokenizer) -> str:
    """The tokenizer's chat template(s) as one text (some tokenizers carry several, by name)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(v for v in t.values() if isinstance(v, str))
    return t if isinstance(t, str) else ""


def _choose(choice: str, template: str, table: dict, aliases: dict, what: str):
    if choice == "none":
        return None
    if choice == "auto":
        return next((p for p in table.values() if p.detects(template)), None)
    name = aliases.get(choice, choice)
    if name not in table:
        known = ", ".join(["auto", "none", *table, *aliases])
        raise ValueError(f"unknown {what} {choice!r}; choose one of {known}")
    return table[name]


def choose_parsers(template: str, tool: str = "auto", reasoning: str = "auto") -> Parsers:
    """Raises ValueError for an unknown name."""
    return Parsers(
        _choose(tool, template, TOOL_PARSERS, TOOL_ALIASES, "tool-call parser"),
        _choose(reasoning, template, REASONING_PARSERS, REASONING_ALIASES, "reasoning parser"),
    )
