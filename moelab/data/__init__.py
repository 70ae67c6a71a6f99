"""Training data: corpora (the Python documentation by default), the byte-level BPE
tokenizer, token shards and the batch sampler; ``moelab.data.prepare.prepare``
tokenises a large corpus into shards as a stream, in several processes (``moelab data
prepare``). A run's data is opened with :func:`open_checked`, which refuses damaged,
foreign or hostile files in one line (see :mod:`moelab.data.shards`)."""

from __future__ import annotations

from moelab.data._checks import config_fix, data_fix
from moelab.data.corpus import DEFAULT_CORPUS_DIR, iter_documents, load_corpus, rst_to_text
from moelab.data.prepare import is_prepared, link_prepared, open_checked
from moelab.data.shards import (
    ShardWriter,
    TokenShard,
    batches,
    corpus_identity,
    open_checked_shard,
    split_documents,
    unigram_entropy,
    write_shard,
    write_shards,
)
from moelab.data.tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer

__all__ = [
    "DEFAULT_CORPUS_DIR",
    "EOS_TOKEN",
    "ShardWriter",
    "TokenShard",
    "Tokenizer",
    "batches",
    "config_fix",
    "corpus_identity",
    "data_fix",
    "is_prepared",
    "iter_documents",
    "link_prepared",
    "load_corpus",
    "open_checked",
    "open_checked_shard",
    "rst_to_text",
    "split_documents",
    "train_tokenizer",
    "unigram_entropy",
    "write_shard",
    "write_shards",
]
