"""The ``flashguard prepare`` subcommand, ready to be wired into ``flashguard.cli``::

    p = sub.add_parser("prepare", help="tokenize a corpus into train.bin/val.bin/meta.json")
    add_prepare_arguments(p)
    ...
    if args.command == "prepare":
        return run_prepare(args)
"""
from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["add_prepare_arguments", "run_prepare", "main"]


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        choices=("embedded", "embedded-docs", "text", "openwebtext"),
        help="embedded: Python's standard library sources (offline, no extra install); "
        "embedded-docs: the same cut into short documents (paragraphs of about 100-250 bytes, "
        "a separator after each: about 2 in a 512-token window, 4 in a 1,024-token one); "
        "text: local UTF-8 files/folders; openwebtext: a Hugging Face dataset, nanoGPT recipe",
    )
    parser.add_argument("paths", nargs="*", help="files or folders (source 'text' only)")
    parser.add_argument("--out", required=True, help="output folder for train.bin, val.bin, meta.json")
    parser.add_argument(
        "--tokenizer", default=None,
        help="byte | gpt2 | auto (default: auto; byte for embedded-docs, gpt2 for openwebtext)",
    )
    parser.add_argument("--val-fraction", type=float, default=0.05, help="embedded/text: share of documents in val")
    parser.add_argument("--max-bytes", type=int, default=None, help="embedded/text: cap on the text size")
    parser.add_argument("--include-tests", action="store_true", help="embedded: also CPython's test suite")
    parser.add_argument("--no-pydoc", action="store_true", help="embedded: leave out the pydoc topics")
    parser.add_argument("--doc-min-bytes", type=int, default=100,
                        help="embedded-docs: paragraphs are joined until a document holds this many bytes")
    parser.add_argument("--doc-max-bytes", type=int, default=250,
                        help="embedded-docs: longer paragraphs are cut at line ends into pieces of at most this")
    parser.add_argument("--skip-invalid", action="store_true", help="text: skip non-UTF-8 files instead of failing")
    parser.add_argument("--dataset", default="openwebtext", help="openwebtext: load_dataset name (e.g. json)")
    parser.add_argument("--data-files", nargs="*", default=None, help="openwebtext: data_files for load_dataset")
    parser.add_argument("--num-proc", type=int, default=None, help="openwebtext: worker processes")
    parser.add_argument("--overwrite", action="store_true", help="replace a complete dataset in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run_prepare(args: argparse.Namespace) -> int:
    from .prepare import prepare_embedded, prepare_embedded_docs, prepare_text
    from .sources import InvalidTextFile
    from .tokenizers import TokenizerUnavailable
    from .writer import DatasetExistsError

    progress = not args.no_progress
    try:
        if args.source in ("embedded", "embedded-docs") and args.paths:
            print(f"flashguard prepare: error: '{args.source}' takes no paths", file=sys.stderr)
            return 2
        if args.source == "embedded":
            meta = prepare_embedded(
                args.out, tokenizer=args.tokenizer or "auto", val_fraction=args.val_fraction,
                max_bytes=args.max_bytes, include_tests=args.include_tests,
                include_pydoc=not args.no_pydoc, overwrite=args.overwrite, progress=progress,
            )
        elif args.source == "embedded-docs":
            meta = prepare_embedded_docs(
                args.out, tokenizer=args.tokenizer or "byte", val_fraction=args.val_fraction,
                doc_min_bytes=args.doc_min_bytes, doc_max_bytes=args.doc_max_bytes,
                max_bytes=args.max_bytes, include_tests=args.include_tests,
                include_pydoc=not args.no_pydoc, overwrite=args.overwrite, progress=progress,
            )
        elif args.source == "text":
            if not args.paths:
                print("flashguard prepare: error: 'text' needs at least one file or folder", file=sys.stderr)
                return 2
            meta = prepare_text(
                args.paths, args.out, tokenizer=args.tokenizer or "auto",
                val_fraction=args.val_fraction, max_bytes=args.max_bytes,
                skip_invalid=args.skip_invalid, overwrite=args.overwrite, progress=progress,
            )
        else:
            from .openwebtext import prepare_openwebtext

            data_files = args.data_files
            if data_files is not None and len(data_files) == 1:
                data_files = data_files[0]
            meta = prepare_openwebtext(
                args.out, dataset=args.dataset, data_files=data_files,
                tokenizer=args.tokenizer or "gpt2", num_proc=args.num_proc,
                overwrite=args.overwrite, progress=progress,
            )
    except DatasetExistsError as e:
        print(str(e), file=sys.stderr)
        return 0 if e.same_recipe else 2
    except (TokenizerUnavailable, InvalidTextFile, FileNotFoundError, ImportError, ValueError) as e:
        print(f"flashguard prepare: error: {e}", file=sys.stderr)
        return 2
    s = meta["splits"]
    lengths = meta.get("document_tokens", {}).get("train", {})
    per_doc = f", median document {lengths['median']:g} tokens" if lengths.get("median") is not None else ""
    print(
        f"{args.out}: tokenizer {meta['tokenizer']} ({meta['tokenizer_note']}), {meta['dtype']}, "
        f"train {s['train']['tokens']:,} tokens / {s['train']['documents']:,} documents, "
        f"val {s['val']['tokens']:,} tokens / {s['val']['documents']:,} documents{per_doc}, "
        f"separator id {meta.get('doc_separator')}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashguard prepare", description=__doc__.splitlines()[0])
    add_prepare_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_prepare(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
