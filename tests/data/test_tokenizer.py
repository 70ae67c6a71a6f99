from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab.data.tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer


def _corpus(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "router", "expert", "token", "mixture", "sparse", "gate", "ünïcode", "🙂"]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) + rng.choice(".\n\t ")
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(_corpus(), vocab_size=400)


@settings(max_examples=40)
@given(text=st.text(max_size=200))
def test_round_trip_any_unicode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", ["", " leading", "\ttab\n\nnew  lines ", "🙂🙂 ok", "\x00é"])
def test_round_trip_examples(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_merges_compress_training_text(tok: Tokenizer) -> None:
    text = "the router gate expert token"
    assert len(tok.encode(text)) < len(text.encode()) / 2
    assert 256 < tok.vocab_size <= 400


def test_eos_is_special_and_not_forgeable(tok: Tokenizer) -> None:
    assert tok.decode([tok.eos_id]) == EOS_TOKEN
    ids = tok.encode(f"a{EOS_TOKEN}b")
    assert tok.eos_id not in ids
    assert tok.decode(ids) == f"a{EOS_TOKEN}b"


def test_save_load_and_determinism(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path / "tok.json")
    loaded = Tokenizer.load(tmp_path / "tok.json")
    text = "the sparse mixture 🙂 of experts"
    assert loaded.encode(text) == tok.encode(text)
    assert (loaded.vocab_size, loaded.eos_id) == (tok.vocab_size, tok.eos_id)
    again = train_tokenizer(_corpus(), vocab_size=400)
    assert again.to_json() == tok.to_json()


def test_vocab_too_small() -> None:
    with pytest.raises(ValueError, match="at least 257"):
        train_tokenizer(["abc"], vocab_size=100)
