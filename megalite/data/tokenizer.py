"""Tokenizers selected by `--tokenizer-type`, with Megatron-LM's semantics.

Each exposes `vocab_size`, `eod`, `bos`, `pad` (None where the tokenizer has none),
`tokenize(text) -> list[int]` and `detokenize(ids) -> str`. The ids must match what
Megatron-LM's own tokenizer of the same name produces, since `tools/preprocess_data.py`
promises byte-identical datasets:

- SentencePieceTokenizer (alias GPTSentencePieceTokenizer): `encode_as_ids` on the text,
  eod = the model's eos id, vocab = the model's pieces. This is Megatron-LM's current
  (core, non-legacy) SentencePiece tokenizer; the legacy wrapper that appended
  <CLS>/<SEP>/<EOD>/<MASK> ids after the vocabulary is not reproduced.
- HuggingFaceTokenizer: a `tokenizer.json` through the `tokenizers` library, with the
  post-processor's special tokens as `transformers` adds them; eos/bos/pad named by a
  `tokenizer_config.json` or `special_tokens_map.json` beside it.
- GPT2BPETokenizer: vocab.json + merges.txt, GPT-2 byte-level BPE; `<|endoftext|>` is the
  eod and, as in Megatron's GPT2Tokenizer, is not recognised inside text.
- NullTokenizer(vocab_size): text is whitespace-separated ids; like Megatron's, it adds
  one id for eod, so `vocab_size` is the flag + 1 and `eod` equals the flag.
"""

import json
import os

from megalite.errors import ConfigError, DataError

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")


def build_tokenizer(tokenizer_type, *, tokenizer_model=None, vocab_file=None,
                    merge_file=None, vocab_size=None):
    """The tokenizer `--tokenizer-type` names, built from the flags it needs."""
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceTokenizer(_required_file(tokenizer_model, "--tokenizer-model",
                                                     tokenizer_type))
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_required_file(tokenizer_model, "--tokenizer-model",
                                                   tokenizer_type))
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_required_file(vocab_file, "--vocab-file", tokenizer_type),
                                _required_file(merge_file, "--merge-file", tokenizer_type))
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type: expected one of {', '.join(TOKENIZER_TYPES)}, "
                      f"got {tokenizer_type!r}")


def _required_file(path, flag, tokenizer_type):
    if path is None:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.exists(path):
        raise DataError(f"{flag} {path}: file not found")
    return path


def _id_or_none(token_id):
    return None if token_id is None or token_id < 0 else token_id


class SentencePieceTokenizer:
    def __init__(self, model_file):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{model_file}: not a SentencePiece model ({e})") from e
        self.vocab_size = self._sp.get_piece_size()
        self.eod = _id_or_none(self._sp.eos_id())
        self.bos = _id_or_none(self._sp.bos_id())
        self.pad = _id_or_none(self._sp.pad_id())

    def tokenize(self, text):
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids):
        return self._sp.decode_ids([int(i) for i in ids])


def _import_tokenizers(tokenizer_type):
    try:
        import tokenizers
    except ImportError as e:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs the `tokenizers` package: "
                          "pip install 'megalite[hf]'") from e
    return tokenizers


class HuggingFaceTokenizer:
    """`path` is a tokenizer.json, or a directory holding one (and its config files)."""

    def __init__(self, path):
        tokenizers = _import_tokenizers("HuggingFaceTokenizer")
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self._tok = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the library raises a bare Exception for bad files
            raise DataError(f"{file}: not a tokenizers tokenizer.json ({e})") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = _special_token_names(folder)
        self.eod = self._token_id(names.get("eos_token"))
        self.bos = self._token_id(names.get("bos_token"))
        self.pad = self._token_id(names.get("pad_token"))

    def _token_id(self, token):
        return None if token is None else self._tok.token_to_id(token)

    def tokenize(self, text):
        return self._tok.encode(text).ids

    def detokenize(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _special_token_names(folder):
    """eos/bos/pad token strings from the config files `transformers` would read."""
    names = {}
    for config in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(folder, config)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for key in ("eos_token", "bos_token", "pad_token"):
            token = data.get(key)
            if isinstance(token, dict):  # {"content": "</s>", "lstrip": false, ...}
                token = token.get("content")
            if isinstance(token, str):
                names[key] = token
    return names


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """vocab.json and merges.txt through `tokenizers`, as HuggingFaceTokenizer (no added or
    special tokens: detokenize skips none)."""

    def __init__(self, vocab_file, merge_file):
        tokenizers = _import_tokenizers("GPT2BPETokenizer")
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if "<|endoftext|>" not in vocab:
            raise DataError(f"--vocab-file {vocab_file}: no <|endoftext|> token to use as eod")
        bpe = tokenizers.models.BPE.from_file(vocab_file, merge_file)
        self._tok = tokenizers.Tokenizer(bpe)
        self._tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = tokenizers.decoders.ByteLevel()
        self.vocab_size, self.eod = len(vocab), vocab["<|endoftext|>"]
        self.bos = self.pad = None


class NullTokenizer:
    def __init__(self, vocab_size):
        if int(vocab_size) < 1:
            raise ConfigError(f"--vocab-size expected >= 1 for NullTokenizer, got {vocab_size}")
        self.vocab_size, self.eod = int(vocab_size) + 1, int(vocab_size)
        self.bos = self.pad = None

    def tokenize(self, text):
        try:
            return [int(word) for word in text.split()]
        except ValueError as e:
            raise DataError(f"NullTokenizer expects whitespace-separated integer ids: {e}") from e

    def detokenize(self, ids):
        return " ".join(str(int(i)) for i in ids)
