"""Generated token ids to streamed text: whole characters, stop strings held back.

:class:`TextStream` turns one request's token ids, one at a time, into the text
pieces its client is sent:

* **whole characters only**: a byte-level tokenizer splits a character of several
  UTF-8 bytes over several tokens; a piece that decodes to an incomplete character
  (U+FFFD at its end) waits for the tokens that complete it. The text is decoded
  with a few tokens of context before it (the prompt's last ones at first), so a
  tokenizer that drops a word's leading space at the start of a decode keeps it;
* **stop strings held back**: text that could be the start of a stop string is not
  sent until the tokens after it show that it is not; a stop string found ends the
  request, and neither it nor anything after it is sent or kept.

The pieces sent, joined, are the result's text. This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]

#: prompt tokens decoded before the first generated one (context for its spacing)
CONTEXT_TOKENS = 5


class TextStream:
    """One request's incremental detokenizer and stop-string matcher.

    :meth:`push` takes a generated token id and returns the text it makes safe to
    send (``""`` while a character or a possible stop string is incomplete);
    :meth:`finish` returns what is left when the request ends. :attr:`stopped` is
    True once a stop string was found (the request must end then)."""

    __slots__ = ("_ids", "_pending", "_prefix", "_prefix_text", "_read", "_tok", "stopped",
                 "stops")

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int],
                 stops: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        #: the ids [prefix, read) were decoded into text already sent (or pending)
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(0, self._read)
        self._pending = ""  # decoded, not sent: it may begin a stop string
        self.stops = tuple(s for s in stops if s)
        self.stopped = False

    def _decode(self, start: int, end: int | None = None) -> str:
        return str(self._tok.decode(self._ids[start:end], skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False))

    def push(self, token: int) -> str:
        """The text that ``token`` makes safe to send."""
        if self.stopped:
            return ""
        self._ids.append(token)
        text = self._decode(self._prefix)
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        new = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        return self._release(new)

    def finish(self) -> str:
        """The request ended (EOS, its max_tokens, a stop token): everything still held
        (an incomplete character's bytes as U+FFFD), up to a stop string if it holds one."""
        if self.stopped:
            return ""
        text = self._decode(self._prefix)
        tail = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        out = self._release(tail, final=True)
        if not self.stopped:
            out += self._pending
            self._pending = ""
        return out

    def _release(self, new: str, final: bool = False) -> str:
        """Add ``new`` to the held text and return what may be sent of it."""
        pending = self._pending + new
        if not self.stops:
            self._pending = ""
            return pending
        cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        hold = 0 if final else self._held(pending)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return pending[:len(pending) - hold]

    def _held(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins a stop string."""
        longest = min(len(text), max(len(s) for s in self.stops) - 1)
        for k in range(longest, 0, -1):
            end = text[-k:]
            if any(s.startswith(end) for s in self.stops):
                return k
        return 0
