"""``raylastic tokenize OUT_DIR [FILES_OR_DIRS ...] [--stdlib]``: text files as a token directory for ``gpt``.

Examples::

    raylastic tokenize data/stdlib --stdlib                      # the Python stdlib's source, ~12 M tokens
    raylastic tokenize data/books books/ notes.md --glob '*.txt' --val-fraction 0.05
    raylastic tokenize data/stdlib --stdlib --force              # replace the token directory made before
"""

from __future__ import annotations

import argparse
import fnmatch
from pathlib import Path

DEFAULT_GLOBS = ("*.txt", "*.md", "*.rst", "*.py")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "tokenize", help="turn text files into train.bin/val.bin for the gpt workload",
        description="Concatenate text files (UTF-8, in the order given, a newline between files) into OUT_DIR's "
        "train.bin, val.bin (the trailing --val-fraction) and meta.json, tokenized by bytes (vocabulary 256). "
        "The files are streamed, so the corpus may be larger than memory. The files are written into a new directory "
        "beside OUT_DIR that is renamed to OUT_DIR once complete, so an interruption leaves OUT_DIR as it was. "
        "Train on the result with --set workload.name=gpt --set workload.options.data_dir=OUT_DIR.")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created if missing); one that holds "
                        "files is refused without --force")
    parser.add_argument("paths", metavar="FILES_OR_DIRS", nargs="*", type=Path,
                        help="text files, taken as given, and directories, searched recursively for files "
                        "matching --glob (sorted by path; hidden files and directories are skipped)")
    parser.add_argument("--stdlib", action="store_true", help="also take every .py file of the Python standard "
                        "library (recursively, without site-packages and test directories) after FILES_OR_DIRS")
    parser.add_argument("--glob", dest="globs", metavar="PATTERN", action="append",
                        help="file-name pattern for files inside directories (repeatable); "
                        f"default: {' '.join(DEFAULT_GLOBS)}")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="share of the tokens, taken from the end, written to val.bin; in (0, 1) (default 0.1)")
    parser.add_argument("--dtype", choices=("uint16", "uint32"), default="uint16",
                        help="token id type on disk (default uint16; bytes fit either)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR; only one holding "
                        "nothing but train.bin, val.bin and meta.json is replaced")
    parser.set_defaults(run=run)


def collect_files(paths: list[Path], globs: tuple[str, ...] | list[str]) -> list[Path]:
    """``paths`` with each directory replaced by its files matching one of ``globs`` (recursive, sorted,
    hidden ones skipped); a file named twice is kept at its first place. Raises ValueError for a path that
    does not exist or a directory with no matching file.

    Example::

        collect_files([Path("notes.md"), Path("books")], ["*.txt"])  # notes.md, then books/**/*.txt
    """
    files: list[Path] = []
    for path in paths:
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file()
                           and any(fnmatch.fnmatch(f.name, pattern) for pattern in globs)
                           and not any(part.startswith(".") for part in f.relative_to(path).parts))
            if not found:
                raise ValueError(f"{path}: no files matching {' '.join(globs)} (choose others with --glob)")
            files.extend(found)
        else:
            raise ValueError(f"{path}: no such file or directory")
    return list(dict.fromkeys(files))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from raylastic.workloads.tokens import prepare_corpus, stdlib_corpus_files

    errors = Console(stderr=True, soft_wrap=True)
    try:
        if not 0.0 < args.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
        files = collect_files(args.paths, args.globs or DEFAULT_GLOBS)
        files += stdlib_corpus_files() if args.stdlib else []
        if not files:
            raise ValueError("no input files: give FILES_OR_DIRS, or --stdlib for the Python standard library")
        meta = prepare_corpus(files, args.out_dir, val_fraction=args.val_fraction, dtype=args.dtype,
                              overwrite=args.force)
    except (ValueError, OSError) as error:
        errors.print(f"[bold red]error:[/] {error}", highlight=False)
        return 2
    out = Path(args.out_dir)
    print(f"wrote {out / 'train.bin'} ({meta['train_tokens']:,} tokens), {out / 'val.bin'} "
          f"({meta['val_tokens']:,} tokens) and {out / 'meta.json'} from {len(files)} files")
    print(f"train on it: raylastic train --set workload.name=gpt --set workload.options.data_dir={out.resolve()}")
    return 0
