"""``moelab data prepare``: tokenise a corpus into token shards."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moelab.cli.common import (
    HelpFormatter,
    add_debug,
    add_json,
    emit,
    interruption,
    source_literals,
    to_json,
)


def format_data(r: dict) -> str:
    docs, toks = r["n_documents"], r["n_tokens"]
    return "\n".join(
        [
            f"prepared         {r['out']} (train with: moelab train --data {r['out']} ...)",
            f"source           {r['source']} ({r['source_format']})",
            f"tokenizer        {r['tokenizer']} ({r['vocab_size']} tokens)",
            f"train            {docs['train']:,} documents, {toks['train']:,} tokens",
            f"val              {docs['val']:,} documents, {toks['val']:,} tokens",
        ]
    )


def _data(args: argparse.Namespace) -> int:
    from moelab.data.corpus import check_trainable_file
    from moelab.data.prepare import prepare

    if args.format in ("auto", "text"):  # one text file of one paragraph: say how to split
        check_trainable_file(args.src, text=args.format == "text")
    try:
        result = prepare(
            args.src,
            args.out,
            tokenizer=args.tokenizer,
            workers=args.workers,
            fmt=args.format,
            field=args.field,
            split=args.split,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            seed=args.seed,
            sample_chars=args.sample_chars,
            overwrite=args.overwrite,
            progress=not args.json,
        )
    except ImportError as e:  # an optional package (pyarrow) to install: the user's to fix
        raise ValueError(str(e)) from e
    except KeyboardInterrupt as err:  # the temporaries are gone; nothing half-written is left
        name, code = interruption(err)
        print(
            f"moelab data: interrupted by {name}; {args.out} holds no prepared data",
            file=sys.stderr,
        )
        if args.json:
            print(to_json({"interrupted": name, "out": str(args.out)}))
        return code
    result["out"] = str(args.out)

    return emit(args, result, format_data)


def register(sub: Any) -> None:
    data = sub.add_parser(
        "data",
        help="prepare a large corpus: token shards that train --data reads",
        description="prepare: tokenise the corpus SRC as a stream, in --workers processes, "
        "into DIR (tokenizer.json, train/val token shards, prepare.json), which "
        "`moelab train --data DIR` trains on as it is. The output is the same for any "
        "--workers; memory does not grow with the corpus. See moelab.data.prepare.",
        formatter_class=HelpFormatter,
    )
    data_sub = data.add_subparsers(dest="action", required=True)
    prep = data_sub.add_parser(
        "prepare",
        help="tokenise SRC into the token shards of DIR",
        description="SRC: a folder of .txt/.md/.rst files (one document per file) or one "
        "such file (one document per paragraph: split at blank lines), a .jsonl "
        "(.jsonl.gz) file or folder (one JSON object per line), a .parquet file or folder, "
        "or a folder saved by datasets' save_to_disk (Parquet and Arrow need pyarrow: pip "
        "install 'moelab[data]'). Rows whose text is null or blank are skipped. Documents go "
        "to validation as in training (a hash of the seed and the document's index). "
        "Ctrl-C leaves no half-written shard.",
        formatter_class=HelpFormatter,
    )
    _prepare_arguments(prep)
    add_json(prep)
    add_debug(prep)
    prep.set_defaults(func=_data)


def _prepare_arguments(prep: argparse.ArgumentParser) -> None:
    """The arguments of moelab data prepare (its defaults: moelab.data.prepare's)."""
    # NOTE: the defaults of moelab.data.prepare and its formats, read from the sources:
    # importing them would load torch for --help
    dp = argparse.Namespace(
        **source_literals(
            "moelab.data.prepare",
            "DEFAULT_VOCAB_SIZE",
            "DEFAULT_SAMPLE_CHARS",
            "DEFAULT_VAL_FRACTION",
            "DEFAULT_SEED",
        ),
        **source_literals("moelab.data.sources", "FORMATS"),
    )

    prep.add_argument("src", metavar="SRC", help="the corpus: file or folder")
    prep.add_argument("--out", required=True, metavar="DIR", help="output folder")
    prep.add_argument(
        "--tokenizer",
        default="moelab",
        metavar="moelab|HF_DIR",
        help="'moelab': train moelab's byte-level BPE (--vocab-size) on the first "
        "--sample-chars characters of training documents; or a Hugging Face tokenizer "
        "directory holding tokenizer.json (<|endoftext|> is added when it lacks it)",
    )
    prep.add_argument(
        "--workers", type=int, default=1, metavar="N", help="encoding processes (one thread each)"
    )
    prep.add_argument(
        "--format",
        default="auto",
        choices=dp.FORMATS,
        help="how to read SRC (auto: from the file names; a saved datasets folder is arrow)",
    )
    prep.add_argument(
        "--field", default="text", help="JSONL field / Parquet or Arrow column holding the text"
    )
    prep.add_argument(
        "--split",
        default=None,
        help="a saved DatasetDict's split (None: train)",
    )
    prep.add_argument(
        "--vocab-size",
        type=int,
        default=dp.DEFAULT_VOCAB_SIZE,
        help="--tokenizer moelab: the BPE's vocabulary",
    )
    prep.add_argument(
        "--sample-chars",
        type=int,
        default=dp.DEFAULT_SAMPLE_CHARS,
        help="--tokenizer moelab: characters of training documents, from the start of the "
        "corpus, that the BPE is trained on",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=dp.DEFAULT_VAL_FRACTION,
        help="share of documents for validation",
    )
    prep.add_argument(
        "--seed", type=int, default=dp.DEFAULT_SEED, help="seed of the train/validation split"
    )
    prep.add_argument(
        "--overwrite", action="store_true", help="replace the prepared data of a non-empty DIR"
    )
