"""A synthetic text corpus and the subword tokenizer the generation workload trains on it, offline.

The generation workload (``hwlib.workloads.polychromic``) turns generated token ids into text and the
text back into encoder tokens, as the seed's trainer did (decode, then re-tokenize for the sentence
encoder). That round trip costs host time; to measure it the lab needs a real tokenizer, and no
machine here reaches a model hub, so one is trained here with Hugging Face ``tokenizers`` (Rust):

* corpus: lines of 4..40 words (uniform) from the pronounceable lexicon of ``hwlib.data.nli``,
  word frequencies Zipf (exponent 1.1) as in natural text, a period every ~8 words;
* tokenizer: byte-pair encoding over whitespace/punctuation pre-tokens, vocabulary ``vocab``
  (special tokens ``[PAD]`` 0, ``[UNK]`` 1, ``[CLS]`` 2, ``[SEP]`` 3), trained on the corpus;
  cached as ``data/poly_tokenizer_v<vocab>_s<seed>.json`` (written atomically).

The language model's vocabulary (151,936 for Qwen3) is larger than this tokenizer's: ``decode``
maps an id to ``id mod vocab`` first. Decoding cost grows with the number of tokens, not with the
vocabulary, so the host time measured is that of a tokenizer of this kind on replies of this length.
"""

from __future__ import annotations

import numpy as np

from .nli import lexicon
from .tokens import data_dir
from ..extras import require
from ..results import write_atomic

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
PAD, UNK, CLS, SEP = range(4)


def synthetic_corpus(n_lines: int, *, n_words: int = 4000, seed: int = 0) -> list[str]:
    """``n_lines`` lines of Zipf-distributed synthetic words with periods (module docstring)."""
    if n_lines < 1:
        raise ValueError(f"n_lines must be >= 1, got {n_lines}")
    words = np.array(lexicon(n_words, 4 * n_words + 16))
    rng = np.random.default_rng(seed)
    p = 1.0 / (np.arange(n_words) + 2.7) ** 1.1
    lens = rng.integers(4, 41, size=n_lines)
    picks = rng.choice(n_words, size=int(lens.sum()), p=p / p.sum())
    stops = rng.random(int(lens.sum())) < 1 / 8
    out, k = [], 0
    for n in lens:
        toks = [w + ("." if s else "") for w, s in zip(words[picks[k:k + n]], stops[k:k + n])]
        out.append(" ".join(toks))
        k += n
    return out


def train_tokenizer(vocab: int = 8192, *, n_lines: int = 20000, seed: int = 0, cache: bool = True):
    """A BPE ``tokenizers.Tokenizer`` of ``vocab`` ids trained on ``synthetic_corpus`` (cached)."""
    tk = require("tokenizers", "the generation workload's tokenizer (notebook 14)")
    Tokenizer, models, pre_tokenizers, decoders, trainers = tk.Tokenizer, tk.models, tk.pre_tokenizers, tk.decoders, tk.trainers
    if not isinstance(vocab, int) or vocab < 64:
        raise ValueError(f"vocab must be an integer >= 64, got {vocab!r}")
    path = data_dir() / f"poly_tokenizer_v{vocab}_s{seed}.json"
    if cache and path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False)
    tok.train_from_iterator(synthetic_corpus(n_lines, seed=seed), trainer=trainer)
    if cache:
        write_atomic(path, tok.to_str())
    return tok


def decode(tok, ids: list[list[int]]) -> list[str]:
    """Texts of id sequences from a larger vocabulary (each id taken mod the tokenizer's size)."""
    v = tok.get_vocab_size()
    return tok.decode_batch([[i % v for i in seq] for seq in ids], skip_special_tokens=True)
