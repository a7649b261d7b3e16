"""Yours to run: turn text into the token files train.py reads: train.bin, val.bin and meta.json.

    python prepare_data.py                                   # the Python standard library's source
    python prepare_data.py --input notes/                    # every UTF-8 text file under a folder
    python prepare_data.py --input book.txt --output_dir data/book
    python prepare_data.py --train_tokenizer 4096            # learn a byte-level BPE on the text
    python prepare_data.py --tokenizer gpt2/tokenizer.json   # a Hugging Face tokenizer file

Tokens are UTF-8 bytes by default (a vocabulary of 256), so any text works offline, with no
tokenizer to download. With --tokenizer or --train_tokenizer the text is encoded by that
tokenizer (tokenizer.py), which is written beside the token files as tokenizer.json. The .bin
files are nanoGPT's format: token ids one after another, uint16 when the vocabulary fits, else
uint32 (meta.json says which); nanoGPT's own prepare scripts can fill a data folder too (then
write meta.json with their vocab_size, or pass --vocab_size to train.py).
"""

import argparse
import json
import sysconfig
from pathlib import Path

import numpy as np

from ddp_utils.errors import InputError
from ddp_utils.knobs import OneLineParser, exit_with_error
from language.tokenizer import ByteTokenizer, JsonTokenizer, token_dtype, train_bpe

# Left out of the default corpus: installed packages, the test suites (huge and repetitive)
# and IDLE.
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib"}


def stdlib_sources():
    root = Path(sysconfig.get_paths()["stdlib"])
    print(f"no --input: using the Python standard library's source in {root}")
    files = sorted(path for path in root.rglob("*.py") if not STDLIB_SKIP & set(path.relative_to(root).parts[:-1]))
    if not files:
        exit_with_error(f"no --input given, and {root} holds no Python source: pass --input")
    return files


def text_files(root):
    if root.is_file():
        return [root]
    # Hidden files and folders (.git, editor state) are not text anyone means to train on.
    files = (path for path in root.rglob("*") if path.is_file())
    return sorted(path for path in files if not any(part.startswith(".") for part in path.relative_to(root).parts))


def main(argv=None):
    parser = OneLineParser(
        description="Write train.bin, val.bin and meta.json (byte tokens) from text files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--input", help="a UTF-8 text file or a folder of them; default: the Python stdlib's source")
    parser.add_argument("--output_dir", default="data/text", help="folder to write the token files to")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="the last this much of the text is validation")
    parser.add_argument("--max_bytes", type=int, default=0, help="use at most this many bytes of text, 0 = all")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--tokenizer", metavar="TOKENIZER_JSON", help="a Hugging Face tokenizer.json; default: bytes")
    choice.add_argument("--train_tokenizer", type=int, metavar="VOCAB_SIZE",
                        help="learn a byte-level BPE tokenizer of this many ids on the text")  # fmt: skip
    args = parser.parse_args(argv)
    if args.train_tokenizer is not None and args.train_tokenizer <= 256:
        exit_with_error("--train_tokenizer must be more than 256 (the byte alphabet it starts from)")
    tokenizer = ByteTokenizer()
    if args.tokenizer:
        try:
            tokenizer = JsonTokenizer(Path(args.tokenizer).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as error:
            exit_with_error(f"--tokenizer {args.tokenizer}: cannot read it ({error})")
        except InputError as error:
            exit_with_error(f"--tokenizer {args.tokenizer}: {error}")
    if not 0 < args.val_fraction < 1:
        exit_with_error("--val_fraction must be between 0 and 1")
    if args.max_bytes < 0:
        exit_with_error("--max_bytes must not be negative")

    if args.input is None:
        files = stdlib_sources()
    elif Path(args.input).exists():
        files = text_files(Path(args.input))
    else:
        exit_with_error(f"--input {args.input} does not exist")

    texts, used, skipped, size = [], 0, 0, 0
    for path in files:
        try:
            data = path.read_bytes()
            data.decode("utf-8")  # only to check: the tokens are the bytes themselves
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        texts.append(data)
        used, size = used + 1, size + len(data) + 2
        if args.max_bytes and size >= args.max_bytes:
            break
    if not texts:
        exit_with_error(f"--input {args.input} has no readable UTF-8 text ({skipped} files, none valid UTF-8)")
    text = b"\n\n".join(texts)  # a blank line between files
    if args.max_bytes:
        text = text[: args.max_bytes]

    if args.train_tokenizer:
        try:
            tokenizer = train_bpe([text.decode("utf-8", errors="replace")], args.train_tokenizer)
        except InputError as error:
            exit_with_error(str(error))
    dtype = token_dtype(tokenizer.vocab_size)
    if isinstance(tokenizer, ByteTokenizer):
        tokens = np.frombuffer(text, dtype=np.uint8).astype(dtype)
    else:  # a file at a time, in parallel inside the library
        pieces = tokenizer.encode_batch([piece.decode("utf-8", errors="replace") for piece in text.split(b"\n\n")])
        separator = tokenizer.encode("\n\n")
        tokens = np.array([t for i, ids in enumerate(pieces) for t in (separator if i else []) + ids], dtype=dtype)
    num_val = int(len(tokens) * args.val_fraction)
    train, val = tokens[: len(tokens) - num_val], tokens[len(tokens) - num_val :]
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    train.tofile(output_dir / "train.bin")
    val.tofile(output_dir / "val.bin")
    meta = {"vocab_size": tokenizer.vocab_size, "tokenizer": "bytes", "dtype": np.dtype(dtype).name}
    if not isinstance(tokenizer, ByteTokenizer):
        (output_dir / "tokenizer.json").write_text(tokenizer.to_text(), encoding="utf-8")
        meta["tokenizer"] = "tokenizer.json"
    (output_dir / "meta.json").write_text(json.dumps(meta) + "\n")
    print(
        f"{used} files ({skipped} skipped: not UTF-8 or unreadable), {len(text):,} bytes -> {output_dir}: "
        f"{len(train):,} train tokens, {len(val):,} val tokens ({meta['tokenizer']}, {meta['dtype']})"
    )


if __name__ == "__main__":
    main()
