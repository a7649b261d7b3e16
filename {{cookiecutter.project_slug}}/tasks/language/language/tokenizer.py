"""Text <-> token ids, for prepare_data.py (writing token files), dataset.py (saying in every
checkpoint which tokenizer its model learned) and sample.py (reading a checkpoint's).

- bytes, the default: a token per UTF-8 byte, 256 ids, nothing to download or train;
- a Hugging Face `tokenizer.json` (GPT-2's, or a byte-level BPE that `train_bpe` makes from
  your text), through the `tokenizers` library (pip install tokenizers).

A tokenizer is saved as text: "bytes", or the tokenizer.json document itself, so a checkpoint
carries the one its model was trained with (`describe` names it in one line).
"""

import hashlib
import json

import numpy as np

from ddp_utils.errors import InputError

BYTES = "bytes"


class ByteTokenizer:
    """A token per UTF-8 byte. Bytes that do not form valid UTF-8 decode to U+FFFD."""

    vocab_size = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def to_text(self):
        return BYTES


class JsonTokenizer:
    """A Hugging Face tokenizer (`tokenizers.Tokenizer`) from its tokenizer.json document."""

    def __init__(self, document):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InputError("a tokenizer.json needs the tokenizers package: pip install tokenizers") from None
        self.document = document
        try:
            self.tokenizer = Tokenizer.from_str(document)
        except Exception as error:  # noqa: BLE001 - the library raises its own exception types
            raise InputError(f"not a tokenizer.json that the tokenizers library reads ({error})") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def to_text(self):
        return self.document


def from_text(text):
    """The tokenizer that `to_text()` wrote: "bytes" or a tokenizer.json document."""
    return ByteTokenizer() if text in (None, BYTES) else JsonTokenizer(text)


def describe(text):
    """One line naming a saved tokenizer: bytes, or a tokenizer.json's vocabulary and digest."""
    if text in (None, BYTES):
        return "bytes (256 ids)"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    try:
        size = len(json.loads(text)["model"]["vocab"])
    except (ValueError, KeyError, TypeError):
        size = "?"
    return f"a tokenizer.json ({size} ids in its model, sha256 {digest})"


def train_bpe(texts, vocab_size):
    """A byte-level BPE tokenizer (GPT-2's kind: any text encodes, nothing is unknown) with
    `vocab_size` ids, learned from `texts` offline."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise InputError("--train_tokenizer needs the tokenizers package: pip install tokenizers") from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes: every text can be encoded
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return JsonTokenizer(tokenizer.to_str())


def token_dtype(vocab_size):
    """The narrowest unsigned type for ids below `vocab_size`: uint16 (nanoGPT's) or uint32."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32
