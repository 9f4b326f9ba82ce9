"""The exceptions for problems the user can fix. BriskError is the base that every front end
catches (the command line prints one `error:` line, the server answers 4xx JSON); the kinds below
it are for what a front end tells apart by class, never by matching the text.

Messages name an option as the Python API and request bodies do (`temperature`, `top_p`), never
as a command-line flag: cli_message() is the message as the command line prints it, with its flags.
"""
from __future__ import annotations

import reprlib

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40


def flag(name: str) -> str:
    """An option's command-line spelling: top_p -> --top-p."""
    return "--" + name.replace("_", "-")


def shown(value) -> str:
    """A value as a message quotes it: numbers as they are, text quoted, long values cut short."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return _REPR.repr(value)


class BriskError(Exception):
    """A problem the user can fix (bad path, bad option, unsupported model): no traceback."""

    def cli_message(self) -> str:
        """The message as the command line prints it."""
        return str(self)


class InvalidValue(BriskError):
    """An option given a value outside its rule: a sampling parameter, a request field, a setting.

    name: the option as the Python API and JSON requests spell it ("top_p", "messages[0].role");
    rule: what the value must be, completing "<name> ..." (e.g. "must be in (0, 1]"). The message
    reads "<name> <rule>, got <value>"; a sentence that needs another shape is given as `template`,
    with {option} where the option's name goes (and the value written into it).
    """

    def __init__(self, name: str, value, rule: str, template: str | None = None):
        self.name, self.value, self.rule, self.template = name, value, rule, template
        super().__init__(self.render(name))

    @property
    def flag(self) -> str:
        """The option as a command-line flag: --top-p."""
        return flag(self.name)

    def render(self, option: str) -> str:
        """The message with the option spelt `option`."""
        if self.template is not None:
            return self.template.replace("{option}", option)
        return f"{option} {self.rule}, got {shown(self.value)}"

    def cli_message(self) -> str:
        return self.render(self.flag)


class PromptTooLong(BriskError):
    """A prompt (or a chat message with what must come with it) that leaves no room in the context.

    tokens: its length; context: the tokens the model was loaded with room for; limit: the most the
    model can be loaded with, when known (the message then says the context can grow to it)."""

    def __init__(self, tokens: int, context: int, limit: int | None = None, what: str = "prompt"):
        self.tokens, self.context, self.limit, self.what = tokens, context, limit, what
        super().__init__(self._say("load the model with a longer context"))

    def _say(self, remedy: str) -> str:
        text = f"the {self.what} is {self.tokens} tokens but the context is {self.context}"
        if self.limit is not None and self.limit > self.context:
            text += f" (shorten it or {remedy}, up to the model's {self.limit})"
        return text

    def cli_message(self) -> str:
        return self._say(f"raise {flag('ctx')}")


class FileError(BriskError):
    """A file or folder brisk cannot use: missing, unreadable, corrupt or incomplete; a model's, or
    one of the user's (requests, calibration text, a saved chat). path: the file, where one is
    named, and line: its line at fault; the message starts with them."""

    def __init__(self, problem: str, path=None, line: int | None = None):
        self.problem, self.path, self.line = problem, path, line
        where = "" if path is None else f"{path}: " if line is None else f"{path}:{line}: "
        super().__init__(where + problem)


class UnsupportedFormat(FileError):
    """A model that brisk reads but does not support: its architecture, rope scaling, GGUF version
    or tensor type, tokenizer or quantization format."""
