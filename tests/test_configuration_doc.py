"""docs/configuration.md is what the CLI's parser renders: the flags' help texts are the documentation."""

from pathlib import Path

from hyserve.cli_doc import COMMAND, markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_doc_is_what_the_cli_renders():
    assert DOC.read_text(encoding="utf-8") == markdown(), f"docs/configuration.md is stale: rerun `{COMMAND}`"


def test_every_option_of_every_command_is_in_it():
    import argparse

    from hyserve.cli import build_parser

    sections = {s.split("\n", 1)[0]: s for s in markdown().split("\n## ")[1:]}
    every = "".join(s for heading, s in sections.items() if heading.endswith("(every command)"))
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            for flag in set(action.option_strings) - {"-h", "--help"}:  # a row, not a mention in another's help
                assert f"| `{flag}" in sections[name] + every, f"hyserve {name} {flag} has no row"
