"""A chat conversation: message history rendered with the model's template, one KV cache reused
across turns (each turn prefills only the tokens the cache does not already hold)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .errors import BriskError, FileError, PromptTooLong
from .files import write_text_atomic
from .generate import Session
from .sampling import SamplingParams


class Chat:
    def __init__(self, llm, system: str | None = None, sampling: SamplingParams | None = None,
                 max_tokens: int = 512, stop: tuple[str, ...] = ()):
        if not llm.tokenizer.has_chat_template:
            raise BriskError(f"{llm.name} has no chat template (a base model?); use `brisk generate --raw`")
        self.llm, self.session = llm, Session(llm)
        self.system, self.sampling = system, sampling or SamplingParams()
        self.max_tokens, self.stop = max_tokens, stop
        self.messages: list[dict] = []
        self.dropped = 0  # turns dropped so far to fit the context
        self.totals = {"turns": 0, "prompt_tokens": 0, "prefilled_tokens": 0, "generated_tokens": 0}

    def reset(self) -> None:
        self.messages, self.dropped = [], 0
        self.session.reset()

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def _render(self, messages: list[dict]) -> list[int]:
        full = ([{"role": "system", "content": self.system}] if self.system else []) + messages
        text = self.llm.tokenizer.apply_chat_template(full, add_generation_prompt=True)
        return self.llm.tokenizer.encode(text, add_special=False)

    def _fit(self, messages: list[dict]) -> tuple[list[dict], list[int], int]:
        """Drop the oldest turns until the prompt leaves room for an answer."""
        room = self.session.cache.max_len - min(self.max_tokens, self.session.cache.max_len // 4)
        dropped = 0
        ids = self._render(messages)
        while len(ids) > room and len(messages) > 1:
            # drop one user message and the assistant reply that followed it
            cut = 2 if len(messages) > 2 and messages[1]["role"] == "assistant" else 1
            messages, dropped = messages[cut:], dropped + 1
            ids = self._render(messages)
        if len(ids) >= self.session.cache.max_len:
            raise PromptTooLong(len(ids), self.session.cache.max_len, what="message")
        return messages, ids, dropped

    def send(self, text: str) -> Iterator[str]:
        """Stream the assistant's answer to `text`; the exchange joins the history when done."""
        if not text.strip():
            raise BriskError("empty message")
        messages, ids, dropped = self._fit(self.messages + [{"role": "user", "content": text}])
        self.dropped += dropped
        self.last_dropped = dropped
        self.messages = messages
        answer = ""
        try:
            for piece in self.session.stream(ids, self.sampling, self.max_tokens, self.stop):
                answer += piece
                yield piece
        finally:  # an interrupted answer is kept as far as it got, like the user saw it
            self.messages.append({"role": "assistant", "content": answer})
            r = self.session.last
            if r is not None:
                self.totals["turns"] += 1
                self.totals["prompt_tokens"] += r.prompt_tokens
                self.totals["prefilled_tokens"] += r.prefilled_tokens
                self.totals["generated_tokens"] += len(r.tokens)

    def save(self, path: str | Path) -> None:
        """Write the conversation as JSON (~ expanded; written whole or not at all), with the KV
        cache's type it ran with. The cache itself is not saved: load() recomputes it from the text
        on the next turn, in the loading chat's type (a session saved with another type is converted)."""
        data = {"system": self.system, "messages": self.messages, "kv_type": self.llm.kv_type.name}
        path = Path(path).expanduser()
        try:
            write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise FileError(f"cannot save the chat ({e.strerror or e})", path) from None

    def load(self, path: str | Path) -> None:
        try:
            data = json.loads(Path(path).expanduser().read_text())
            messages = data["messages"]
            ok = all(isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
                     and isinstance(m.get("content"), str) for m in messages)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FileError(f"not a saved chat ({e})", path) from None
        if not ok:
            raise FileError("messages must be objects with a role and a string content", path)
        self.system, self.messages = data.get("system"), messages
