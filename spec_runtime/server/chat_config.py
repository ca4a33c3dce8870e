"""Chat settings of `spec-runtime serve`: the chat template and the tool-call parser."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from spec_runtime.server.tool_calls import PARSERS


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ChatConfig:
    """How chat requests become prompts, and how tool calls are read out of the output."""

    chat_template: str | None = _f(None, "A Jinja chat template, as a file path or as the template text; it "
                                         "replaces the model's own (e.g. to render tools).")
    tool_call_parser: str = _f("auto", "How tool calls are read from the output with tool_choice auto: hermes "
                                       "(<tool_call>{json}</tool_call>), llama3_json, or auto (by what the chat "
                                       "template renders).")

    def __post_init__(self) -> None:
        if self.tool_call_parser not in ("auto", *PARSERS):
            raise ValueError(f"tool_call_parser must be auto, {' or '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.chat_template is not None:
            self.template_text()  # a missing file fails at start, not at the first request

    def template_text(self) -> str | None:
        """The template's text: the file's contents, or the string itself if it is a template."""
        t = self.chat_template
        if t is None:
            return None
        if "{{" in t or "{%" in t:
            return t
        if not os.path.isfile(t):
            raise ValueError(f"chat_template {t!r} is neither a file nor a Jinja template")
        with open(t, encoding="utf-8") as f:
            return f.read()
