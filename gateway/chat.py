"""OpenAI's chat and completions, the codec: request bodies checked as OpenAI checks them,
the chat template rendered, tokens turned back into text as they come, stop strings
found, and the answers and stream chunks in OpenAI's shapes. No I/O here (the routes:
gateway/routes/openai.py).

What is refused, with a 400 naming the field: ``n`` > 1, tools and functions, logprobs,
``echo``, ``suffix``, ``best_of`` > 1, a list of several prompts. Sampling
(``temperature``, ``top_p``, ``seed``) is passed to a model that declares those inputs;
a model that decodes greedily refuses a ``temperature`` above 0 rather than answer
something else than was asked.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from zeroserve.gateway.openai import OpenAIError

__all__ = ["Detokenizer", "GenerationRequest", "chunk", "completion", "parse_chat",
           "parse_completions", "render_chat", "usage"]

MAX_STOPS = 4          # OpenAI's bound on stop sequences
ROLES = ("system", "developer", "user", "assistant", "tool")
# fields OpenAI defines that this server does not do: refused, never ignored
_REFUSED_CHAT = {"tools": "tools", "tool_choice": "tools", "functions": "functions",
                 "function_call": "functions", "logprobs": "logprobs",
                 "top_logprobs": "logprobs", "audio": "audio", "prediction": "prediction"}
_REFUSED_COMPLETIONS = {"logprobs": "logprobs", "echo": "echo", "suffix": "suffix"}


@dataclass(frozen=True)
class GenerationRequest:
    model: str
    chat: bool
    prompt: str | None               # completions: the text, or
    prompt_ids: list[int] | None     # its token ids
    messages: list[dict[str, Any]] | None   # chat
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    temperature: float | None
    top_p: float | None
    seed: int | None
    user: str


def _number(doc: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise OpenAIError(f"'{name}' must be a number from {low:g} to {high:g}, got {value!r}",
                          name)
    return float(value)


def _integer(doc: dict[str, Any], name: str, low: int) -> int | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OpenAIError(f"'{name}' must be an integer >= {low}, got {value!r}", name)
    return value


def _common(doc: Any, refused: dict[str, str]) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise OpenAIError("the body must be a JSON object")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required: the name of a served model", "model")
    for key, param in refused.items():
        value = doc.get(key)
        if value is not None and value is not False and value != [] and value != 0:
            raise OpenAIError(f"'{key}' is not supported by this server", param)
    n = _integer(doc, "n", 1)
    if n is not None and n > 1:
        raise OpenAIError("'n' > 1 is not supported: send the request n times", "n")
    stop = doc.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and \
            len(stop) <= MAX_STOPS:
        stops = tuple(stop)
    else:
        raise OpenAIError(f"'stop' must be a string or a list of at most {MAX_STOPS} strings",
                          "stop")
    if any(not s for s in stops):
        raise OpenAIError("'stop' holds an empty string", "stop")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError("'stream' must be true or false", "stream")
    options = doc.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False),
                                                        bool):
        raise OpenAIError("'stream_options' must be {\"include_usage\": true|false}",
                          "stream_options")
    user = doc.get("user", "")
    if not isinstance(user, str):
        raise OpenAIError("'user' must be a string", "user")
    return {"model": model, "stop": stops, "stream": stream,
            "include_usage": bool(options.get("include_usage", False)) and stream,
            "temperature": _number(doc, "temperature", 0.0, 2.0),
            "top_p": _number(doc, "top_p", 0.0, 1.0), "seed": _integer(doc, "seed", 0),
            "user": user}


def parse_completions(doc: Any) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` a string or token ids (one prompt)."""
    common = _common(doc, _REFUSED_COMPLETIONS)
    best_of = _integer(doc, "best_of", 1)
    if best_of is not None and best_of > 1:
        raise OpenAIError("'best_of' > 1 is not supported", "best_of")
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # one prompt in a list
    text, ids = None, None
    if isinstance(prompt, str) and prompt:
        text = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise OpenAIError("one prompt a request: send several prompts as several requests",
                          "prompt")
    else:
        raise OpenAIError("'prompt' must be a non-empty string or list of token ids", "prompt")
    max_tokens = _integer(doc, "max_tokens", 1)
    return GenerationRequest(chat=False, prompt=text, prompt_ids=ids, messages=None,
                             max_tokens=16 if max_tokens is None else max_tokens, **common)


def parse_chat(doc: Any) -> GenerationRequest:
    """``POST /v1/chat/completions``: ``messages`` of roles and text content."""
    common = _common(doc, _REFUSED_CHAT)
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list of {role, content}",
                          "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise OpenAIError(f"messages[{i}] must be an object whose role is one of "
                              f"{', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):
                raise OpenAIError(f"messages[{i}].content: only text parts are supported",
                                  "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise OpenAIError(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    given = doc.get("max_completion_tokens", doc.get("max_tokens"))
    if isinstance(given, bool) or given is not None and (not isinstance(given, int) or
                                                         given < 1):
        raise OpenAIError(f"'max_completion_tokens' must be an integer >= 1, got {given!r}",
                          "max_completion_tokens")
    return GenerationRequest(chat=True, prompt=None, prompt_ids=None, messages=out,
                             max_tokens=given, **common)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


def _raise(message: str) -> None:
    raise TemplateError(message)


_ENV.globals["raise_exception"] = _raise


def render_chat(template: str | None, messages: list[dict[str, Any]],
                special: dict[str, str]) -> str:
    """The prompt a chat model was trained on, from its tokenizer's chat template (a
    sandboxed Jinja template, as transformers renders it), the generation prompt added."""
    if not template:
        raise OpenAIError("this model has no chat template (its tokenizer_config.json or "
                          "chat_template.jinja): use /v1/completions", "model")
    try:
        return _ENV.from_string(template).render(messages=messages,
                                                 add_generation_prompt=True, **special)
    except TemplateError as exc:
        raise OpenAIError(f"the model's chat template refused the messages: {exc}",
                          "messages") from None


class Detokenizer:
    """Tokens back to text as they come. What is sent never changes: text that may still
    become a stop string, or an unfinished UTF-8 character, is held back until it is
    known. A stop string ends the text before it."""

    def __init__(self, decode: Any, stops: Sequence[str]) -> None:
        self._decode = decode    # ids -> text
        self._stops = tuple(stops)
        self.ids: list[int] = []
        self._text = ""
        self._sent = 0
        self.stopped = False

    def add(self, ids: Sequence[int]) -> str:
        """The new text that may be sent after ``ids`` (empty once stopped)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):   # a character whose bytes have not all come
            return ""
        self._text = text
        found = [i for i in (text.find(s, max(0, self._sent - len(s) + 1))
                             for s in self._stops) if i >= 0]
        if found:
            self.stopped = True
            return self._take(min(found))
        hold = max((k for s in self._stops for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        return self._take(len(text) - hold)

    def rest(self) -> str:
        """At the end of the tokens: what was held back and turned out not to be a stop,
        an unfinished last character included (as the tokenizer decodes it)."""
        if self.stopped:
            return ""
        self._text = self._decode(self.ids)
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        out = self._text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class Ids:
    """One answer's identity: its id and creation time, the same in every chunk."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())


def chunk(ids: Ids, model: str, text: str | None, finish: str | None,
          first: bool = False) -> dict[str, Any]:
    """One stream chunk: a piece of text, or the end (``finish``)."""
    if ids.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first \
            else ({"content": text} if text else {})
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": model,
            "choices": [choice]}


def usage_chunk(ids: Ids, model: str, counts: dict[str, int]) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    kind = "chat.completion.chunk" if ids.chat else "text_completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": model,
            "choices": [], "usage": counts}


def completion(ids: Ids, model: str, text: str, finish: str,
               counts: dict[str, int]) -> dict[str, Any]:
    """The whole answer, not streamed."""
    if ids.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                          "content": text},
                                  "logprobs": None, "finish_reason": finish}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": model,
            "choices": [choice], "usage": counts}
