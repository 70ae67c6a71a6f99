"""Training data: corpora (the Python documentation by default), the byte-level BPE
tokenizer, token shards and the batch sampler."""

from __future__ import annotations

from moelab.data.corpus import DEFAULT_CORPUS_DIR, iter_documents, load_corpus, rst_to_text
from moelab.data.shards import (
    TokenShard,
    batches,
    split_documents,
    unigram_entropy,
    write_shard,
    write_shards,
)
from moelab.data.tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer

__all__ = [
    "DEFAULT_CORPUS_DIR",
    "EOS_TOKEN",
    "TokenShard",
    "Tokenizer",
    "batches",
    "iter_documents",
    "load_corpus",
    "rst_to_text",
    "split_documents",
    "train_tokenizer",
    "unigram_entropy",
    "write_shard",
    "write_shards",
]
