"""Step 31: every packed batch padded up to a row-count bucket before the model sees it
(``hwlib.steps.s31_bucketed_graphs.buckets``), so that a whole training step has one of a few shapes
and can be replayed as a CUDA graph (``graphs.py``, the session's step on a GPU).

The padding is a forward pre-hook on the model rather than a change of the loader: the model a step
trains is what the ladder's same-gradients check runs, so the check steps through the padding too.
The session's graphed step pads into its static buffers first; the hook then finds a bucket and pads
nothing. ``buckets`` is imported when the step is applied: a notebook of another step never loads it."""

from __future__ import annotations

from ..step import require


class PadToBucket:
    """A forward pre-hook: a packed batch's ids, pos and seq padded up to their bucket; a padded batch
    (the model called with ``keep``, steps 01-10) passes untouched."""

    def __init__(self, buckets: tuple[int, ...]):
        from .buckets import pad_to_bucket
        self.buckets, self.pad = buckets, pad_to_bucket

    def __call__(self, module, args, kwargs):
        if kwargs.get("seq") is None:
            return None
        ids, labels = args[0], args[1] if len(args) > 1 else kwargs.pop("labels", None)
        ids, pos, seq, cls, labels = self.pad((ids, kwargs["pos"], kwargs["seq"], kwargs["cls"], labels),
                                              self.buckets)
        return (ids, labels), {**kwargs, "pos": pos, "seq": seq}


def apply(model):
    from ...workloads.encoder_nli import EncoderNLI
    from .buckets import default_buckets
    require(isinstance(model, EncoderNLI), "31_bucketed_graphs", "needs the NLI encoder "
            "(hwlib.workloads.encoder_nli.EncoderNLI), whose packed batches it pads", type(model).__name__)
    model.row_buckets = default_buckets(model.cfg)
    model.register_forward_pre_hook(PadToBucket(model.row_buckets), with_kwargs=True)
    return model
