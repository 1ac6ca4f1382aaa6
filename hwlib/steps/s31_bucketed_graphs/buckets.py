"""Row-count buckets for the packed NLI batch: the shapes a CUDA graph can be recorded for.

Step 11 packs each batch's pairs first-fit into R rows of ``pack_len`` tokens, and R changes from batch
to batch (3 or 4 at the full profile). A CUDA graph replays fixed shapes, so a whole-step graph needs a
fixed set of R: each batch is padded up to the smallest bucket B >= R with B - R rows that belong to no
pair:

    ids = [PAD], pos = 0, seq = -1   on every token of a padding row

The model's attention mask is ``seq_q == seq_k`` within a row, so a padding row's tokens attend only to
each other (never an empty softmax row, never a pair's token); the classifier reads each pair's [CLS]
by its flat index ``cls`` into the first R rows, which padding appended after them leaves unchanged.
Nothing of a padding row reaches the loss, so its gradient there is exactly zero, and every parameter's
gradient gains only exact zeros (a sum over the padding tokens of zero outputs' gradients): the same
loss and gradients as the unpadded batch, up to the order a longer reduction sums in.

What a bucket costs: each is one more graph to compile, warm up, capture and keep (its activations in
its own memory pool); each padding row is pack_len tokens of work that no pair needs. ``choose_buckets``
keeps every row count the data produces as its own bucket, except counts rarer than ``min_share`` of
the batches, which round up to the next bucket (the largest count always stays: nothing rounds down).
``bucket_stats`` measures both on the loader's real row counts.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch

from ...data import nli as nli_data
from ...data.loader import StepSampler

MAX_BUCKETS = 4       # graphs per session: each holds its own activations
MIN_SHARE = 0.05      # a row count in fewer batches than this pads up to the next bucket


def _check_buckets(buckets) -> tuple[int, ...]:
    b = tuple(buckets) if isinstance(buckets, (tuple, list)) else None
    if not b or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b) or list(b) != sorted(set(b)):
        raise ValueError(f"buckets must be a non-empty increasing sequence of positive ints, got {buckets!r}")
    return b


def bucket_for(rows: int, buckets) -> int:
    """The smallest bucket that holds ``rows`` packed rows; ``rows`` itself past the largest bucket (a
    row count the bucket set was not chosen on gets a graph of its own rather than an error)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int (packed rows of a batch), got {rows!r}")
    return next((b for b in _check_buckets(buckets) if b >= rows), rows)


def choose_buckets(counts, max_buckets: int = MAX_BUCKETS, min_share: float = MIN_SHARE) -> tuple[int, ...]:
    """Buckets for row counts seen ``counts`` times ({rows: batches}): every count its own bucket, but those
    in fewer than ``min_share`` of the batches, which pad up to the next bucket; then, while there are more
    than ``max_buckets``, the bucket whose removal adds the fewest padding rows is merged up. The largest
    count always stays a bucket."""
    if not isinstance(counts, dict) or not counts or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 1 or isinstance(n, bool) or not isinstance(n, int)
            or n < 1 for r, n in counts.items()):
        raise ValueError(f"counts must be a non-empty {{rows: batches}} of positive ints, got {counts!r}")
    if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
        raise ValueError(f"max_buckets must be a positive int, got {max_buckets!r}")
    if not 0.0 <= min_share < 1.0:
        raise ValueError(f"min_share must be in [0, 1), got {min_share!r}")
    total = sum(counts.values())
    top = max(counts)
    keep = [r for r in sorted(counts) if r == top or counts[r] >= min_share * total]

    def padding(bs):
        return sum(n * (bucket_for(r, bs) - r) for r, n in counts.items())
    while len(keep) > max_buckets:
        drop = min(keep[:-1], key=lambda r: padding(tuple(b for b in keep if b != r)))
        keep.remove(drop)
    return tuple(keep)


def pad_rows(batch, rows: int):
    """A packed batch (ids, pos, seq, cls, labels; ``PackCollate``'s) with padding rows appended up to
    ``rows`` rows (module doc: they attend only to each other and reach no loss)."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 5:
        raise ValueError("batch must be a packed NLI batch (ids, pos, seq, cls, labels), got "
                         + (f"{len(batch)} tensors" if isinstance(batch, (tuple, list)) else type(batch).__name__))
    ids, pos, seq, cls, labels = batch
    R, T = ids.shape
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < R:
        raise ValueError(f"rows must be an int of at least the batch's {R} packed rows, got {rows!r}")
    if rows == R:
        return tuple(batch)
    extra = rows - R
    return (torch.cat([ids, ids.new_full((extra, T), nli_data.PAD)]), torch.cat([pos, pos.new_zeros((extra, T))]),
            torch.cat([seq, seq.new_full((extra, T), -1)]), cls, labels)


def pad_to_bucket(batch, buckets):
    """``pad_rows`` up to ``bucket_for`` of the batch's row count."""
    return pad_rows(batch, bucket_for(int(batch[0].shape[0]), buckets))


def row_counts(cfg, seed: int = 0, n_batches: int | None = None, source: str | None = None) -> dict[int, int]:
    """{packed rows: batches} over batches 0..n_batches-1 in the loader's order (default: one epoch)."""
    import warnings
    from ...workloads.encoder_nli import dataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # truncated pairs: the loader reports them where it reads the set
        ds = dataset(cfg, seed, source)
    order = StepSampler(len(ds), cfg.batch, seed)
    n = order.per_epoch if n_batches is None else n_batches
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n_batches must be a positive int or None (one epoch), got {n_batches!r}")
    c = Counter(1 + max(r for r, _ in nli_data.pack_rows(ds.lengths[order.indices(i)], cfg.pack_len))
                for i in range(n))
    return dict(sorted(c.items()))


@functools.lru_cache(maxsize=8)
def default_buckets(cfg) -> tuple[int, ...]:
    """The buckets of the config's synthetic set (seed 0, one epoch): ``choose_buckets`` of its row counts."""
    return choose_buckets(row_counts(cfg))


def bucket_stats(counts: dict[int, int], buckets, pack_len: int) -> dict:
    """What ``buckets`` cost on the row counts ``counts`` ({rows: batches}): graphs, padding rows and tokens,
    and their share of the rows the step then runs."""
    real = sum(r * n for r, n in counts.items())
    run = sum(bucket_for(r, buckets) * n for r, n in counts.items())
    used = sorted({bucket_for(r, buckets) for r in counts})
    return {"buckets": tuple(used), "graphs": len(used), "batches": sum(counts.values()),
            "rows packed": real, "rows run": run, "padding rows": run - real,
            "padding tokens a batch": (run - real) * pack_len / sum(counts.values()),
            "padding share": (run - real) / run}


def powers_of_two(counts) -> tuple[int, ...]:
    """The powers of two that hold ``counts``' row counts: the bucket set that needs no data."""
    return tuple(sorted({1 << (r - 1).bit_length() for r in counts}))
