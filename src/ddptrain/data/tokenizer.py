"""Tokenizers for `ddptrain prepare --tokenizer T`: raw bytes, a `tokenizer.json`, or a BPE trained here.

`bytes` needs nothing installed and keeps the historic corpus (uint8, vocab 256, no document
separator). The other two use Hugging Face `tokenizers` (the `hf` extra), loaded from local files only.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddptrain.data.meta import MAX_VOCAB
from ddptrain.errors import ConfigError, DataError
from ddptrain.safe_files import read_regular_file

TOKENIZER_FILE = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
HF_EXTRA_HINT = "install the optional extra: pip install 'ddptrain[hf]'"


def require_hf(what: str) -> None:
    """ConfigError naming the `hf` extra when `tokenizers`/`transformers` are not installed."""
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs Hugging Face transformers and tokenizers; {HF_EXTRA_HINT}") from None


def smallest_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype holding every id below vocab_size."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise DataError(f"vocabulary of {vocab_size} does not fit in uint32")


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class TokenizerSpec:
    """What `--tokenizer` asked for: kind is 'bytes', 'file' (a tokenizer.json) or 'train' (BPE of vocab_size)."""

    kind: str
    path: Path | None = None
    vocab_size: int = 256

    @staticmethod
    def parse(text: str) -> TokenizerSpec:
        """'bytes', 'train:VOCAB' or a path to a tokenizer.json; ConfigError otherwise."""
        if text == "bytes":
            return TokenizerSpec("bytes")
        if text.startswith("train:"):
            raw = text.removeprefix("train:")
            if not raw.isdigit() or not 257 <= int(raw) <= MAX_VOCAB:
                raise ConfigError(
                    f"--tokenizer {text!r}: VOCAB must be an integer from 257 to {MAX_VOCAB} (2**24; e.g. train:8192)"
                )
            return TokenizerSpec("train", vocab_size=int(raw))
        path = Path(text)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise ConfigError(f"--tokenizer {text!r}: not 'bytes', 'train:VOCAB' or an existing tokenizer.json")
        return TokenizerSpec("file", path=path)


class Tokenizer:
    """Encodes documents to token-id arrays; decodes ids to text. eos_id is None for raw bytes."""

    def __init__(self, hf: Any | None, vocab_size: int, eos_id: int | None) -> None:
        self.hf, self.vocab_size, self.eos_id = hf, vocab_size, eos_id
        self.dtype = smallest_dtype(vocab_size)

    def encode_batch(self, docs: list[bytes]) -> np.ndarray:
        """The documents' tokens, each followed by the end-of-document id (when there is one)."""
        if self.hf is None:
            return np.frombuffer(b"".join(docs), dtype=np.uint8).copy()
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        parts: list[np.ndarray] = []
        eos = np.array([self.eos_id], dtype=self.dtype)
        # encode_batch_fast (tokenizers >= 0.21) skips the offsets: same ids, ~25% less memory per document.
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        for enc in encode(texts, add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=self.dtype))
            parts.append(eos)
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def encode(self, text: str) -> list[int]:
        """Token ids of one text (no end-of-document id)."""
        if self.hf is None:
            return list(text.encode("utf-8"))
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids; invalid UTF-8 is replaced, special tokens are kept."""
        if self.hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return str(self.hf.decode(ids, skip_special_tokens=False))


def load_tokenizer_file(path: Path, expected_sha256: str | None = None) -> Tokenizer:
    """A `tokenizer.json` from disk; its EOS is the `<|endoftext|>` token, else its last special token.

    expected_sha256: what meta.json recorded; the bytes are read once, checked against it and parsed (DataError
    naming the file on a mismatch: a tokenizer swapped after training would silently change every token)."""
    require_hf(f"tokenizer {path}")
    from tokenizers import Tokenizer as HFTokenizer

    text = None if expected_sha256 is None else _read_checked(path, expected_sha256)
    try:
        hf = HFTokenizer.from_file(str(path)) if text is None else HFTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception subclasses for malformed files
        raise DataError(f"cannot load tokenizer {path}: {e}") from None
    eos_id = hf.token_to_id(EOS_TOKEN)
    if eos_id is None:
        specials = [t for t in hf.get_added_tokens_decoder().values() if t.special]
        if not specials:
            raise DataError(f"tokenizer {path} has no special token to separate documents (add {EOS_TOKEN!r})")
        eos_id = hf.token_to_id(specials[-1].content)
    vocab_size = hf.get_vocab_size(with_added_tokens=True)
    if vocab_size > MAX_VOCAB:  # what meta.json may declare (data/meta.py says why)
        raise DataError(f"tokenizer {path} has {vocab_size} tokens, more than the {MAX_VOCAB} a corpus may have")
    return Tokenizer(hf, vocab_size, eos_id)


def _read_checked(path: Path, expected_sha256: str) -> str:
    """The text of the file at path, read once, when its SHA-256 is expected_sha256; DataError otherwise."""
    try:
        data = read_regular_file(path, follow=True)  # a FIFO is refused, never waited on
    except OSError as e:
        raise DataError(f"cannot read tokenizer {path}: {e.strerror or e}") from None
    if hashlib.sha256(data).hexdigest() != expected_sha256:
        raise DataError(
            f"tokenizer {path} does not match the SHA-256 its meta.json records (replaced after the corpus was "
            "prepared?); restore it, or prepare the corpus again"
        )
    return data.decode("utf-8", errors="replace")


def train_bpe(docs: Iterable[bytes], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE of vocab_size on the documents; write it atomically to out (a tokenizer.json)."""
    require_hf("--tokenizer train:VOCAB")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    # Byte-level: every byte has a token, so any input round-trips (no unknown token).
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def texts() -> Iterator[str]:
        for d in docs:
            yield d.decode("utf-8", errors="replace")

    hf.train_from_iterator(texts(), trainer=trainer)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    hf.save(str(tmp))
    os.replace(tmp, out)
    return out


def byte_tokenizer_json(out: Path) -> Path:
    """A `tokenizer.json` whose ids are the raw byte values (for exporting byte-level models to transformers)."""
    require_hf("a byte-level tokenizer.json")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    # ByteLevel maps each byte to a printable character; a BPE without merges whose vocabulary
    # sends the character of byte b to id b encodes text to exactly its UTF-8 bytes.
    chars = _byte_level_chars()
    hf = HFTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.save(str(out))
    return out


def _byte_level_chars() -> list[str]:
    """GPT-2's byte-to-character table (printable bytes map to themselves, the rest above 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]
