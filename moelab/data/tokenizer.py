"""Byte-level BPE tokenizer, trained offline with the Hugging Face ``tokenizers`` library.

Byte-level (as GPT-2): text is split into UTF-8 bytes first, each byte being one of the 256
initial tokens, so every string round-trips exactly, ``decode(encode(s)) == s``, whatever
its script, emoji, tabs or leading spaces, and no token is ever unknown. BPE merges are
learnt on top. One special token, ``<|endoftext|>`` (:attr:`Tokenizer.eos_id`), is
appended after each document when a corpus is tokenised; text that merely *contains*
that string is encoded as ordinary bytes, so documents cannot forge it.

    tok = train_tokenizer(docs, vocab_size=8192)
    tok.save(run / "tokenizer.json"); tok = Tokenizer.load(run / "tokenizer.json")
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from moelab.data._checks import one_line, remedy

EOS_TOKEN = "<|endoftext|>"
N_BYTES = 256

__all__ = ["EOS_TOKEN", "Tokenizer", "train_tokenizer"]


class Tokenizer:
    """A trained byte-level BPE tokenizer (wraps ``tokenizers.Tokenizer``)."""

    def __init__(self, hf: _HFTokenizer) -> None:
        eos = hf.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(
                f"the tokenizer has no {EOS_TOKEN!r} token; train it with train_tokenizer()"
            )
        # NOTE: a document containing the text "<|endoftext|>" must not produce eos_id;
        # only shards.py appends it, between documents.
        hf.encode_special_tokens = True
        self._hf = hf
        self.eos_id: int = eos

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (ids are 0 .. vocab_size - 1)."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of each text, in parallel (Rust threads)."""
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; ``eos_id`` decodes to ``"<|endoftext|>"``."""
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self._hf.to_str()

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        return cls(_HFTokenizer.from_str(text))

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as one JSON file (the ``tokenizers`` format)."""
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """The tokenizer saved in ``path``. Raises ``FileNotFoundError`` when it is
        missing and ``ValueError``, in one line naming the file and what to do, when it
        is not UTF-8, not a ``tokenizers`` JSON file (e.g. truncated) or lacks the
        end-of-document token."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"{path} is not UTF-8 text, so not a tokenizer; {remedy(path.parent)}"
            ) from None
        try:
            hf = _HFTokenizer.from_str(text)
        except Exception as e:  # the tokenizers library raises its own Exception
            raise ValueError(
                f"{path} is not a tokenizers JSON file ({one_line(e)}): it is truncated or "
                f"damaged; {remedy(path.parent)}"
            ) from None
        try:
            return cls(hf)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts``.

    ``vocab_size`` counts the 256 byte tokens, the merges and the end-of-document token;
    a small corpus may give fewer tokens (see :attr:`Tokenizer.vocab_size`). Pairs seen
    fewer than ``min_frequency`` times are not merged. Deterministic: the same texts in
    the same order give the same tokenizer (merge ties are broken by token id).
    """
    if not N_BYTES + 1 <= vocab_size <= 2**32 - 1:
        raise ValueError(
            f"vocab_size={vocab_size}: a byte-level tokenizer needs at least "
            f"{N_BYTES + 1} tokens (256 bytes + end-of-document)"
        )
    hf = _HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)
