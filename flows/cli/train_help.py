"""`lightning-rl train --help`: its ~90 options in sections (the command's own, the run's, then
each section of TrainConfig), one sentence each, in click's plain layout.

Rich's option table gave every name a fixed column: at 80 columns long names were cut
("--updates-per-it…") and the help ran to ~500 lines. Click's layout puts a long name on its
own line instead of cutting it; the whole descriptions are on the settings reference page.
"""

from __future__ import annotations

import re

import click
from typer.core import TyperCommand

COMMAND = "Command"
RUN = "Run"
NESTED = "Nested settings: a JSON object, merged over the default (or --config's)"
# The sections whose settings have flat option names, and the title of each.
SECTION_TITLES = {
    "rollouts": "Rollouts (rollouts.*)",
    "server": "Policy server (server.*)",
    "data": "Data (data.*)",
    "evaluation": "Evaluation (evaluation.*)",
}
ORDER = [COMMAND, RUN, *SECTION_TITLES.values(), NESTED]
REFERENCE = "docs/reference/settings.md"
# The end of a sentence: a full stop before a capital (not "e.g. x", not "1.5B").
_SENTENCE_END = re.compile(r"(?<=\.)\s+(?=[A-Z`'(])")
# What click appends to an option's help: "[default: 12]" and the like.
_EXTRA = re.compile(r"\s*(\[(?:default|required)[^\]]*\])\s*$")


def first_sentence(text: str) -> str:
    return _SENTENCE_END.split(text.strip(), maxsplit=1)[0]


class TrainCommand(TyperCommand):
    """`train` with its options in sections and each described by its first sentence."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            names, help_text = record
            extra = _EXTRA.search(help_text)
            short = first_sentence(_EXTRA.sub("", help_text))
            if extra:
                short = f"{short}  {extra.group(1)}"
            panel = getattr(param, "rich_help_panel", None) or COMMAND
            sections.setdefault(panel, []).append((names, short))
        for title in sorted(sections, key=lambda t: ORDER.index(t) if t in ORDER else len(ORDER)):
            with formatter.section(title):
                formatter.write_dl(sections[title])

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_paragraph()
        formatter.write_text(
            f"Each setting is shown by its first sentence; {REFERENCE} has them whole, with "
            "their types and limits."
        )
