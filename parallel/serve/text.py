"""The server's text: the checkpoint's tokenizer (:class:`Text`), what a stream has sent of each
choice (:class:`TextCursor`) and a choice's final text (:func:`final_text`, ``reshard.LLM``'s).

A stream's text grows a step at a time; :class:`GrowingText` decodes only its tail after each step
(vLLM's incremental detokenizer does the same), so a choice of ``n`` tokens costs O(n) to stream,
where decoding the whole output at every event cost O(n^2): ~2 ms a token on this CPU at 4,096
tokens with stop strings, on the thread that runs the HTTP server.
"""

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.parallel.engine.request import Completion
from reshard.parallel.engine.sampling import SamplingParams
from reshard.parallel.serve.protocol import BadRequest
from reshard.parallel.vllm_api import ended_by_string, in_context, output_text, render_chat

LOG = logging.getLogger("reshard.parallel.serve.app")  # (the server's messages, its logger)


@dataclass(frozen=True)
class Text:
    """The checkpoint's tokenizer as the server uses it."""

    tokenizer: Any
    eos_ids: frozenset[int] = frozenset()  # the model's (its configs') and the tokenizer's EOS ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def chat(self, messages: list[dict], template: Mapping[str, Any], special_tokens: bool = False) -> list[int]:
        """The ids of ``messages`` through the chat template with ``template`` (its arguments:
        ``add_generation_prompt``, ``continue_final_message``, a request's ``chat_template_kwargs``),
        as ``reshard.LLM.chat`` renders them (:func:`~reshard.parallel.vllm_api.render_chat`);
        ``special_tokens``: the tokenizer's own too, as vLLM's ``/tokenize`` may ask."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("the checkpoint's tokenizer has no chat template: use /v1/completions", "messages")
        return render_chat(self.tokenizer, messages, template, special_tokens)[1]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token])


class TextCursor:
    """How much of one choice's text a stream has sent: text goes out as tokens land, short of
    an incomplete character and of a possible stop string's start (held back until the choice
    finishes); the final text is the offline job's (:func:`final_text`)."""

    def __init__(self, text: Text, sampling: SamplingParams, prompt: list[int]) -> None:
        self.text, self.sampling = text, sampling
        self.decode = decoder(text, sampling, prompt)  # (its prompt's suffix found once)
        self.growing = GrowingText(self.decode)  # (a step's events decode the output's tail only)
        eos = frozenset() if sampling.ignore_eos else text.eos_ids
        self.stop_ids = eos | frozenset(sampling.stop_token_ids or ())
        self.sent, self.tokens = "", 0
        self.ids: list[int] = []  # the stream's ids so far

    def advance(
        self, items: list[tuple[int, Any]], finish: str | None, stopped_by: int | str | None = None
    ) -> tuple[str, list]:
        """The new text and the new ``(token, logprobs)`` items since the last call (``finish``,
        ``stopped_by``: the completion's, once it finished). A last token that may have ended the
        choice (a stop token past ``min_tokens``) keeps its text back until the completion says."""
        ids, p, final = self._ids(items, finish), self.sampling, finish is not None
        decode = self.decode if final else self.growing  # (the final text: decoded whole)
        if finish is None and len(ids) > p.min_tokens and ids[-1] in self.stop_ids:
            ids = ids[:-1]  # (vLLM's text never holds the stop token that ended it)
        if finish is None and ended_by_string(decode, ids, p.stop, p.min_tokens) is not None:
            finish = "stop"  # (the engine ends the choice at this token: its text is cut as it will be)
        full = output_text(decode, ids, finish, p, stopped_by)[0]
        if finish is None:
            full = full.rstrip("\ufffd")
            full = full[: max(0, len(full) - max(map(len, p.stop), default=1) + 1)]
        if not full.startswith(self.sent):
            if not final:  # (a byte-fallback run's character turned back into bytes: wait for them)
                return "", self._fresh(items)
            # (decoding is not prefix-stable here: what was sent cannot be taken back)
            LOG.warning("a stream's text so far %r is not a prefix of its text %r", self.sent[-40:], full[-40:])
            self.sent = full[: len(self.sent)]
        new = full[len(self.sent) :]
        self.sent += new
        return new, self._fresh(items)

    def _fresh(self, items: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """The items new since the last call."""
        fresh, self.tokens = items[self.tokens :], len(items)
        return fresh

    def _ids(self, items: list[tuple[int, Any]], finish: str | None) -> list[int]:
        """The output's ids: the completion's once it finished (authoritative), else the stream's,
        extended by the items new since the last call."""
        if finish is not None:
            return [t for t, _ in items]
        self.ids += [t for t, _ in items[len(self.ids) :]]
        return self.ids


def final_text(text: Text, c: Completion, sampling: SamplingParams) -> str:
    """Completion ``c``'s text, ``reshard.LLM``'s: decoded after its prompt (special tokens skipped
    unless ``skip_special_tokens=False``), cut before the stop string that ended it, without the stop
    token that ended it (both kept with ``include_stop_str_in_output``)."""
    decode = decoder(text, sampling, c.prompt_ids)
    return output_text(decode, c.output_ids, c.finish_reason, sampling, c.stopped_by)[0]


def decoder(text: Text, sampling: SamplingParams, prompt: list[int]) -> Callable[[list[int]], str]:
    """Output ids -> their text after ``prompt`` (:func:`~reshard.parallel.vllm_api.in_context`)."""
    return in_context(functools.partial(text.decode, skip_special_tokens=sampling.skip_special_tokens), prompt)


class GrowingText:
    """``decode(ids)`` of an output that grows (each call's ``ids`` extend the last ones), decoding
    a window: the text of the first ``k`` ids is kept, and the rest is decoded after the
    :attr:`ANCHOR` ids before it, whose own text is then taken off (a tokenizer that drops a
    word's leading space at the start of a text, or a character split across tokens, decodes them
    alike both times). The kept part moves on once :attr:`SETTLE` ids past it have a whole
    character's text. Anything else (shorter ids, another prefix, a window whose text does not
    begin with its anchor's) is decoded whole."""

    ANCHOR = 4  # ids decoded before the window's own, their text taken off
    SETTLE = 32  # ids left in the window when the kept part moves on

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.kept: list[int] = []  # the first k ids of the output
        self.kept_text = ""  # ... their text
        self.anchor = ""  # the text of the last ANCHOR kept ids, decoded alone

    def __call__(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        text = self._windowed(ids)
        if text is None:
            text = self.decode(ids)
        if len(ids) - len(self.kept) >= 2 * self.SETTLE:
            self._settle(ids, text)
        return text

    def _windowed(self, ids: list[int]) -> str | None:
        """``ids``' text as the kept text and the window's (None: not decodable so)."""
        k = len(self.kept)
        if k == 0 or len(ids) < k or ids[k - 1] != self.kept[-1] or ids[:k] != self.kept:
            return None
        window = self.decode(ids[max(k - self.ANCHOR, 0) :])
        return self.kept_text + window[len(self.anchor) :] if window.startswith(self.anchor) else None

    def _settle(self, ids: list[int], text: str) -> None:
        """Keep all but the last :attr:`SETTLE` of ``ids`` (whose text is ``text``), where their
        text is a prefix of ``text`` ending in a whole character."""
        k = len(ids) - self.SETTLE
        anchor = self.decode(ids[max(k - self.ANCHOR, 0) : k])
        if "\ufffd" in anchor:  # (it begins or ends inside a character: a byte-fallback run decodes it
            return  # as replacement characters whatever follows, so a window would not tell)
        head = self._windowed(ids[:k]) if self.kept else self.decode(ids[:k])
        if head is None or head.endswith("\ufffd") or not text.startswith(head):
            return
        self.kept, self.kept_text, self.anchor = ids[:k], head, anchor
