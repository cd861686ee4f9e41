"""A byte-level tokenizer: 256 byte values plus BOS and EOS.

Every string encodes (its UTF-8 bytes) and every id sequence decodes, so the
reference model needs no vocabulary file. Generation streams one byte per token,
and a multi-byte character may be split across tokens: :class:`StreamDecoder`
holds the incomplete bytes back until the character is whole.

This module does not import torch.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

__all__ = ["BOS", "EOS", "VOCAB_SIZE", "StreamDecoder", "decode", "encode"]

#: beginning of sequence: the model prepends it to every prompt
BOS = 256
#: end of sequence: generation stops when it is sampled (unless told not to)
EOS = 257
VOCAB_SIZE = 258


def _check(token: int) -> int:
    if not 0 <= token < VOCAB_SIZE:
        raise ValueError(f"token id {token!r} is outside the vocabulary [0, {VOCAB_SIZE})")
    return token


def encode(text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` as token ids (no BOS/EOS added)."""
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """The text of ``ids``: special tokens are dropped, invalid UTF-8 becomes U+FFFD.

    Raises ValueError for an id outside the vocabulary.
    """
    return bytes(t for t in map(_check, ids) if t < 256).decode("utf-8", errors="replace")


class StreamDecoder:
    """Incremental detokenizer: :meth:`push` one token, get the text it completes.

    The text pushed so far, plus :meth:`flush`, equals :func:`decode` of all the
    ids: a character split across tokens comes out whole with its last byte
    (``""`` before that), and invalid bytes become U+FFFD as in :func:`decode`.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """The text completed by ``token`` (``""`` for a special token or a partial character)."""
        if _check(token) >= 256:
            return ""
        return self._decoder.decode(bytes((token,)))

    def flush(self) -> str:
        """End of stream: the pending bytes of an incomplete character, as U+FFFD."""
        return self._decoder.decode(b"", final=True)
