"""How a conversation is written out for a model: the model's own chat template when it has
one (Jinja, rendered as Hugging Face ``transformers`` renders it), the mesh's role tags
otherwise (the reference model has none).

A layout renders a whole message list; the prompt builder relies on one property of it,
checked in tests for each layout: rendering is append-only, so that turn N+1's prompt
starts with turn N's prompt and answer (engine prefix caches and session affinity pay off).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmmesh.runtime.errors import InvalidArgument, Unavailable
from llmmesh.types import Role, Turn

ROLE_NAMES = {Role.SYSTEM: "system", Role.USER: "user", Role.ASSISTANT: "assistant"}


class ChatLayout(Protocol):
    def __hash__(self) -> int: ...  # layouts key the prompt builder's caches

    def render(self, turns: Sequence[Turn], *, generation_prompt: bool) -> str:
        """The messages as the model reads them; with ``generation_prompt``, followed by
        the cue for the assistant's answer."""


MESH_TAGS = {Role.SYSTEM: "<|system|>", Role.USER: "<|user|>", Role.ASSISTANT: "<|assistant|>"}


class MeshLayout:
    """The mesh's own: a role tag on a line, then the text, for models without a template."""

    def render(self, turns: Sequence[Turn], *, generation_prompt: bool) -> str:
        text = "".join(f"{MESH_TAGS[t.role]}\n{t.text}\n" for t in turns)
        return text + (f"{MESH_TAGS[Role.ASSISTANT]}\n" if generation_prompt else "")


MESH_LAYOUT = MeshLayout()


class TemplateLayout:
    """A model's Jinja chat template, in the sandbox and with the helpers ``transformers``
    gives templates (``raise_exception``, ``strftime_now``, its ``tojson``)."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
        try:
            self._template = environment.from_string(template)
        except jinja2.TemplateError as exc:
            raise Unavailable(f"the model's chat template does not compile: {exc}") from None
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, turns: Sequence[Turn], *, generation_prompt: bool) -> str:
        messages = [{"role": ROLE_NAMES[t.role], "content": t.text} for t in turns]
        try:
            text: str = self._template.render(
                messages=messages, add_generation_prompt=generation_prompt, **self._tokens
            )
        except TemplateRefused as exc:  # the template's own check of the conversation
            raise InvalidArgument("messages", str(exc)) from None
        except jinja2.TemplateError as exc:
            raise Unavailable(f"the model's chat template failed: {exc}") from None
        return text


class TemplateRefused(jinja2.TemplateError):
    """A template's ``raise_exception``: the conversation is not one it can write out."""


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise TemplateRefused(message)
