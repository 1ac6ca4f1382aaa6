"""Step 31's training step: forward, backward and AdamW captured as ONE CUDA graph per row-count bucket
and replayed, so that a step costs the host one copy of the batch and one graph launch.

Step 09 compiles the model with mode="reduce-overhead": its forward and backward are replayed from
CUDA graphs (one per packed row count), but between them the host still runs dynamo's guards, the
autograd engine, cudagraph trees' bookkeeping and, after them, AdamW's step and zero_grad, launch by
launch. At the NLI encoder's few tokens a step that host time is as long as the GPU's work (notebook 16,
``outputs/reference/h100-breakdown``: 4.2 ms of 10.0 idle). A hand-captured graph holds all of it.

Per bucket (``buckets.py``), at the first batch of that shape:

1. warm-up: ``WARMUP`` eager steps on that batch on a side stream (torch's rule before a capture),
   which compile the model for the shape (``dynamic=False``: the graph's shapes are the bucket's),
   create AdamW's state and settle the allocator; then every parameter, gradient and AdamW state is
   put back as it was, so that the warm-up trains nothing;
2. capture of: gradients zeroed in place, forward + backward (gradients accumulate into the same
   tensors every replay), AdamW (``capturable``: its step counts stay on the GPU; the update is the
   fused kernel's as before), the loss into a static output;
3. every step of that bucket, this one included: the batch copied into the bucket's static input
   buffers (padding rows written with it), one replay, the loss copied out.

The math is the ladder's: each step's batch padded with rows that reach no loss, then the same
forward, backward and fused AdamW. On a CPU, with fp16's GradScaler (its skipped steps need the host) or
with micro-batches, there is no graph: ``make_trainer`` returns None and the session steps as before.
"""

from __future__ import annotations

import torch

from ...ops import fallbacks
from .buckets import default_buckets, pad_rows, bucket_for

WARMUP = 3   # eager steps before a capture: compile, AdamW's state, a settled allocator


class BucketedGraphs:
    """The session's step as a CUDA graph per bucket (module doc). ``step(batch)`` trains on one packed
    batch and returns its loss (a copy: the next replay overwrites the graph's output)."""

    def __init__(self, model, fwd, opt, loss_fn, autocast, buckets, device: torch.device, cuda_graph: bool = True):
        self.model, self.fwd, self.opt, self.loss_fn, self.autocast = model, fwd, opt, loss_fn, autocast
        self.buckets, self.device = tuple(buckets), device
        self.cuda_graph = cuda_graph and device.type == "cuda"
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.graphs: dict[int, tuple] = {}   # bucket -> (graph, static batch, static loss)
        self.side = None
        if self.cuda_graph:
            # Captured AdamW must keep its step counts on the GPU; the fused update is the same kernel.
            for g in opt.param_groups:
                g["capturable"] = True

    def _body(self, batch) -> torch.Tensor:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        with self.autocast():
            loss = self.loss_fn(self.fwd, batch)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def _snapshot(self) -> dict:
        with torch.no_grad():
            return {"p": [p.detach().clone() for p in self.params],
                    "state": {id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                              for p, s in self.opt.state.items()}}

    def _restore(self, snap: dict) -> None:
        """Parameters and AdamW's state as in ``snap``; state created since (the first warm-up's) back to
        AdamW's initial zeros, which is what a state created at the next real step starts from."""
        with torch.no_grad():
            for p, v in zip(self.params, snap["p"]):
                p.copy_(v)
            for p, s in self.opt.state.items():
                before = snap["state"].get(id(p), {})
                for k, v in s.items():
                    if torch.is_tensor(v):
                        v.copy_(before[k]) if k in before else v.zero_()

    def _capture(self, bucket: int, batch):
        # The bucket's input buffers, warmed up on as they will be captured: fresh tensors, without the
        # loader's dynamic-dimension mark, so that the model compiles for this bucket's shape alone.
        static = tuple(t.clone() for t in batch)
        snap = self._snapshot()
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            for _ in range(WARMUP):
                self._body(static)
        torch.cuda.current_stream(self.device).wait_stream(self.side)
        self._restore(snap)
        del snap
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = self._body(static)
        self.graphs[bucket] = (graph, static, loss)

    def step(self, batch) -> torch.Tensor:
        bucket = bucket_for(int(batch[0].shape[0]), self.buckets)
        batch = pad_rows(batch, bucket)
        if not self.cuda_graph:
            return self._body(batch)
        if bucket not in self.graphs:
            self._capture(bucket, batch)
        graph, static, loss = self.graphs[bucket]
        for dst, src in zip(static, batch):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return loss.clone()

    def close(self) -> None:
        self.graphs.clear()
        self.side = None


def make_trainer(sess):
    """The session's step as ``BucketedGraphs`` (a callable batch -> loss), or None where it cannot be
    graphed (module doc): the session then steps as the step before does, with the padding."""
    if sess.device.type != "cuda" or sess.scaler is not None or sess.micro_batch:
        return None
    fallbacks.declare()
    # Compiled without reduce-overhead's own graphs (they cannot nest in this capture), one shape a bucket.
    fwd = torch.compile(sess.model, dynamic=False) if (sess.settings.compile or sess.settings.cuda_graphs) else sess.model
    buckets = getattr(sess.model, "row_buckets", None) or default_buckets(sess.cfg)
    return BucketedGraphs(sess.model, fwd, sess.opt, sess.wl.loss, sess.autocast, buckets, sess.device).step
