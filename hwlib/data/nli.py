"""Premise/hypothesis pairs for the encoder_nli workload: a synthetic set and a JSONL loader.

Both are map-style data sets for ``hwlib.data.loader.LoaderBatches``: ``sample(index, epoch)`` builds
one pair's token ids on the CPU (text generation and tokenisation happen there, as in a real
pipeline) and returns ``(ids, label)``, ids = [CLS] premise [SEP] hypothesis [SEP] without padding.
The collates below turn a list of samples into a padded batch or a packed one.

Tokenizer: words, not subwords. Text is lower-cased and split into runs of word characters and
single punctuation marks (``\\w+|[^\\w\\s]``); each piece maps to
``4 + blake2b(piece) mod (vocab - 4)`` (ids 0-3 are [PAD], [CLS], [SEP], [UNK]). A hash, not
Python's salted ``hash()``, so that every worker process and every run agrees on the ids. One
piece is one token, so the token count of a pair is known from a split alone.

Synthetic pairs (``SyntheticNLI``), MNLI-like in length and label balance:

* premise: LogNormal(mu=ln 25 - 0.18, sigma=0.6) words, rounded and clipped to [3, 300], then a
  period: mean ~26 tokens, median 22, 1% above 84, a tail to ~180 in 20,000 pairs (MNLI's
  premises average roughly 22 words, with a long tail);
* hypothesis: LogNormal(mu=ln 12 - 0.10, sigma=0.45) words clipped to [2, 60], then a period
  (and "not" where negated): mean ~13 tokens; a pair averages ~42 tokens, median 38;
* words from a synthetic lexicon of ``n_words`` pronounceable words (``"bakome"``) with Zipf
  frequencies (exponent 1.1), chosen so that no two words share a token id;
* label uniform over entailment (0), neutral (1), contradiction (2), the relation decides the
  hypothesis: entailment takes an ordered subset of the premise's words; contradiction takes the
  same plus the negation "not"; neutral takes words absent from the premise, and "not" with
  probability 0.15, so that "not" alone does not give the label away: the model has to compare
  the hypothesis with the premise.

The lengths are drawn for the whole set up front (vectorised), the words per sample from a
generator seeded by (seed, index): a pair is the same in every epoch and every process, and the
set's length statistics (padding waste, truncations, FLOPs) are known without generating text.

A pair longer than the context is truncated longest-first (tokens are cut from the end of the
longer of premise and hypothesis until it fits, as Hugging Face's ``longest_first``); each data
set counts its truncated pairs in ``.truncated`` and warns when there are any.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import warnings
from pathlib import Path

import numpy as np
import torch

PAD, CLS, SEP, UNK = 0, 1, 2, 3
N_RESERVED = 4
LABELS = ("entailment", "neutral", "contradiction")
NEGATION = "not"
MIN_CONTEXT = 8

_PIECE = re.compile(r"\w+|[^\w\s]")


def split_words(text: str) -> list[str]:
    return _PIECE.findall(text.lower())


@functools.lru_cache(maxsize=1 << 17)
def word_id(word: str, vocab: int) -> int:
    h = int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")
    return N_RESERVED + h % (vocab - N_RESERVED)


def tokenize(text: str, vocab: int) -> list[int]:
    return [word_id(w, vocab) for w in split_words(text)]


def truncate_pair(lp: int, lh: int, budget: int) -> tuple[int, int]:
    """Lengths after longest-first truncation to ``lp + lh <= budget``."""
    excess = lp + lh - budget
    if excess <= 0:
        return lp, lh
    long_, short = max(lp, lh), min(lp, lh)
    if long_ - short >= excess:
        long_ -= excess
    else:
        short = budget // 2
        long_ = budget - short
    return (long_, short) if lp >= lh else (short, long_)


def pair_lengths(lp: np.ndarray, lh: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Token counts of [CLS] p [SEP] h [SEP] after truncation to ``context``, and which were cut."""
    lp, lh = np.asarray(lp, dtype=np.int64), np.asarray(lh, dtype=np.int64)
    budget = context - 3
    cut = lp + lh > budget
    out = lp + lh + 3
    out[cut] = context
    return out, cut


def encode_pair(p_ids: list[int], h_ids: list[int], context: int) -> torch.Tensor:
    a, b = truncate_pair(len(p_ids), len(h_ids), context - 3)
    return torch.tensor([CLS, *p_ids[:a], SEP, *h_ids[:b], SEP], dtype=torch.long)


def _check_context(context: int, vocab: int) -> None:
    if context < MIN_CONTEXT:
        raise ValueError(f"context must be at least {MIN_CONTEXT} tokens ([CLS] p [SEP] h [SEP]), got {context}")
    if vocab <= N_RESERVED + 2:
        raise ValueError(f"vocab must exceed {N_RESERVED + 2}, got {vocab}")


def warn_truncated(n: int, total: int, context: int, what: str) -> None:
    if n:
        warnings.warn(f"{what}: {n} of {total} pairs are longer than the context of {context} tokens "
                      f"and are truncated (longest first)", stacklevel=3)


# --- synthetic pairs ------------------------------------------------------------------------------

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]


def _spell(k: int) -> str:
    k += len(_SYLLABLES)   # at least two syllables
    out = []
    while k:
        k, r = divmod(k, len(_SYLLABLES))
        out.append(_SYLLABLES[r])
    return "".join(out)


def lexicon(n_words: int, vocab: int) -> list[str]:
    """``n_words`` synthetic words whose token ids differ from each other, from "not" and from "."."""
    if n_words > (vocab - N_RESERVED - 2) // 2:
        raise ValueError(f"n_words ({n_words}) must be at most half the hashed vocabulary "
                         f"({(vocab - N_RESERVED - 2) // 2} for vocab {vocab})")
    used = {word_id(NEGATION, vocab), word_id(".", vocab)}
    words, k = [], 0
    while len(words) < n_words:
        w = _spell(k)
        k += 1
        i = word_id(w, vocab)
        if i not in used:
            used.add(i)
            words.append(w)
    return words


class SyntheticNLI:
    """Learnable premise/hypothesis pairs (see the module docstring for what is drawn)."""

    P_MU, P_SIGMA, P_MAX = float(np.log(25) - 0.18), 0.6, 300
    H_MU, H_SIGMA, H_MAX = float(np.log(12) - 0.10), 0.45, 60
    NEUTRAL_NEGATION = 0.15

    def __init__(self, n: int, vocab: int, context: int, seed: int = 0, n_words: int = 8000):
        _check_context(context, vocab)
        if n < 1:
            raise ValueError(f"the synthetic set needs at least one pair, got n={n}")
        self.n, self.vocab, self.context, self.seed = n, vocab, context, seed
        self.words = lexicon(n_words, vocab)
        rng = np.random.default_rng([seed, 0x4E4C49])
        self.labels = rng.integers(0, 3, size=n)
        self.premise_words = np.clip(np.rint(rng.lognormal(self.P_MU, self.P_SIGMA, n)), 3, self.P_MAX).astype(np.int64)
        hyp = np.clip(np.rint(rng.lognormal(self.H_MU, self.H_SIGMA, n)), 2, self.H_MAX).astype(np.int64)
        from_premise = self.labels != 1
        self.hyp_words = np.where(from_premise, np.minimum(hyp, self.premise_words), hyp)
        self.negated = (self.labels == 2) | ((self.labels == 1) & (rng.random(n) < self.NEUTRAL_NEGATION))
        p_tokens = self.premise_words + 1                       # the period
        h_tokens = self.hyp_words + self.negated + 1
        self.lengths, cut = pair_lengths(p_tokens, h_tokens, context)
        self.truncated = int(cut.sum())
        freq = 1.0 / (np.arange(n_words) + 2.7) ** 1.1
        self._cdf = np.cumsum(freq / freq.sum())
        self._rank_to_word = np.random.default_rng([seed, 0x57]).permutation(n_words)
        warn_truncated(self.truncated, n, context, "synthetic NLI set")

    def __len__(self) -> int:
        return self.n

    def _draw(self, rng, k: int) -> np.ndarray:
        ranks = np.minimum(np.searchsorted(self._cdf, rng.random(k)), len(self._cdf) - 1)
        return self._rank_to_word[ranks]

    def text(self, index: int) -> tuple[str, str, int]:
        """Premise, hypothesis and label of pair ``index``."""
        rng = np.random.default_rng([self.seed, int(index), 1])
        label = int(self.labels[index])
        lp, lh = int(self.premise_words[index]), int(self.hyp_words[index])
        premise = self._draw(rng, lp)
        if label == 1:
            seen, hyp = set(premise.tolist()), []
            while len(hyp) < lh:
                hyp += [w for w in self._draw(rng, 2 * lh + 8).tolist() if w not in seen][: lh - len(hyp)]
        else:
            hyp = premise[np.sort(rng.choice(lp, size=lh, replace=False))].tolist()
        spelled = [self.words[w] for w in hyp]
        if self.negated[index]:
            spelled.insert(int(rng.integers(0, len(spelled) + 1)), NEGATION)
        return " ".join(self.words[w] for w in premise) + ".", " ".join(spelled) + ".", label

    def sample(self, index: int, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        premise, hypothesis, label = self.text(index)
        ids = encode_pair(tokenize(premise, self.vocab), tokenize(hypothesis, self.vocab), self.context)
        return ids, torch.tensor(label, dtype=torch.long)


# --- a local JSONL file ---------------------------------------------------------------------------

def _label(value, path: Path, lineno: int) -> int:
    if isinstance(value, str) and value.strip().lower() in LABELS:
        return LABELS.index(value.strip().lower())
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 3:
        return value
    raise ValueError(f"{path}, line {lineno}: unknown label {value!r}; use 0, 1, 2 or "
                     f"{', '.join(repr(s) for s in LABELS)}")


class JsonlNLI:
    """Pairs from a local JSONL file: one object a line with ``premise``, ``hypothesis`` (strings)
    and ``label`` (0-2 or entailment / neutral / contradiction); blank lines are skipped. Every
    line is checked on load; an error names the file, the line and what is wrong with it."""

    def __init__(self, path, vocab: int, context: int):
        _check_context(context, vocab)
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"NLI data file {str(p)!r} does not exist")
        if not p.is_file():
            raise ValueError(f"NLI data file {str(p)!r} is not a regular file")
        self.path, self.vocab, self.context = p, vocab, context
        self.premises: list[str] = []
        self.hypotheses: list[str] = []
        labels, lp, lh = [], [], []
        with open(p, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{p}, line {lineno}: not UTF-8 text (byte {e.start}: {e.reason})") from None
                if lineno == 1:
                    line = line.removeprefix("\ufeff")   # a byte-order mark some editors write
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}, line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{p}, line {lineno}: expected a JSON object with premise, hypothesis "
                                     f"and label, got {type(obj).__name__}")
                for key in ("premise", "hypothesis", "label"):
                    if key not in obj:
                        raise ValueError(f"{p}, line {lineno}: missing field {key!r} (has {sorted(obj)})")
                for key in ("premise", "hypothesis"):
                    if not isinstance(obj[key], str):
                        raise ValueError(f"{p}, line {lineno}: field {key!r} must be a string, "
                                         f"got {type(obj[key]).__name__}")
                labels.append(_label(obj["label"], p, lineno))
                self.premises.append(obj["premise"])
                self.hypotheses.append(obj["hypothesis"])
                lp.append(len(split_words(obj["premise"])))
                lh.append(len(split_words(obj["hypothesis"])))
        if not labels:
            raise ValueError(f"NLI data file {str(p)!r} has no premise/hypothesis pairs")
        self.labels = np.asarray(labels, dtype=np.int64)
        self.lengths, cut = pair_lengths(np.asarray(lp), np.asarray(lh), context)
        self.truncated = int(cut.sum())
        warn_truncated(self.truncated, len(labels), context, str(p))

    def __len__(self) -> int:
        return len(self.labels)

    def sample(self, index: int, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        ids = encode_pair(tokenize(self.premises[index], self.vocab), tokenize(self.hypotheses[index], self.vocab),
                          self.context)
        return ids, torch.tensor(int(self.labels[index]), dtype=torch.long)


# --- batches: padded, or packed -------------------------------------------------------------------

def pack_rows(lengths, row_len: int) -> list[tuple[int, int]]:
    """First-fit decreasing: (row, offset) for each sequence so that no row exceeds ``row_len``.
    Deterministic: ties in length keep batch order."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    free: list[int] = []
    place = [(0, 0)] * len(lengths)
    for i in order:
        n = int(lengths[i])
        if n > row_len:
            raise ValueError(f"a sequence of {n} tokens does not fit a packed row of {row_len}")
        r = next((r for r, f in enumerate(free) if f >= n), None)
        if r is None:
            r = len(free)
            free.append(row_len)
        place[i] = (r, row_len - free[r])
        free[r] -= n
    return place


class PadCollate:
    """Every sequence padded to ``context``, as the seed does: (ids [B, T], keep [B, T] bool, labels [B])."""

    def __init__(self, context: int):
        self.context = context

    def __call__(self, samples):
        ids = torch.full((len(samples), self.context), PAD, dtype=torch.long)
        keep = torch.zeros((len(samples), self.context), dtype=torch.bool)
        for b, (x, _) in enumerate(samples):
            ids[b, : len(x)] = x
            keep[b, : len(x)] = True
        return ids, keep, torch.stack([y for _, y in samples])


class PackCollate:
    """The same samples packed into rows of ``context`` tokens (first-fit decreasing):
    (ids [R, T], pos [R, T] position within its own sequence, seq [R, T] sample index in the batch
    or -1 for the row's tail, cls [B] flat index of each sample's [CLS], labels [B] in batch order).
    Only the row count R varies between batches: a handful of shapes for compiled graphs."""

    def __init__(self, context: int):
        self.context = context

    def __call__(self, samples):
        place = pack_rows([len(x) for x, _ in samples], self.context)
        rows = 1 + max(r for r, _ in place)
        ids = torch.full((rows, self.context), PAD, dtype=torch.long)
        pos = torch.zeros((rows, self.context), dtype=torch.long)
        seq = torch.full((rows, self.context), -1, dtype=torch.int32)
        cls = torch.empty(len(samples), dtype=torch.long)
        for b, ((x, _), (r, o)) in enumerate(zip(samples, place)):
            n = len(x)
            ids[r, o:o + n] = x
            pos[r, o:o + n] = torch.arange(n)
            seq[r, o:o + n] = b
            cls[b] = r * self.context + o
        return ids, pos, seq, cls, torch.stack([y for _, y in samples])
