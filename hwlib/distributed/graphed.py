"""The whole training step as one CUDA graph, the gradient sync inside it.

Under torch's DDP a compiled step cannot be CUDA-graphed (DDP's reducer launches its all-reduces
from autograd hooks between the compiled graphs), so at a few sequences per GPU the host's launches
take longer than the GPU's work: GPT-2 small on two H200s at 8 sequences a GPU computed 19 ms of a
52 ms step and sat idle 31 (``outputs/reference/h200x2``). Here DDP's math is written out over flat
buffers that never move, so that forward, backward, every reduction and AdamW are captured once and
replayed as one graph, whose launches cost the host nothing:

- every parameter is a view into one flat fp32 buffer, every gradient a view into another (the
  buffers are cut into buckets in the reverse order of registration, about the order backward
  produces gradients in);
- a gradient hook counts each bucket's parameters; when the last one's gradient is accumulated the
  bucket's collective is launched at once (asynchronously, on NCCL's stream) while backward goes on
  with the blocks before it;
- ``GraphedStep`` (strategy ``graphed``): each bucket all-reduced, then divided by the world size
  (the mean over ranks, as DDP), then AdamW on every parameter, as one process;
- ``graphed_zero1``: each bucket reduce-scattered instead; each rank runs AdamW on its shard of every
  bucket only (ZeRO stage 1: optimizer states 1/K per rank) and all-gathers the updated parameters,
  at the end of the step or (``overlap_gather``) at the start of the next one, each block's forward
  waiting only for its own buckets;
- ``reduce_dtype='bf16'``: each bucket is reduced in bf16 (half the bytes) and turned back to fp32.

The model is compiled unit by unit (each block of ``model.blocks``, and the loss head where the
model has one), so that a block's gradients exist while backward still runs the blocks below it:
compiled as one graph, the whole backward would end before any reduction could start. On a CPU, or
with ``cuda_graph=False``, the same step runs eagerly (that is how CI checks its math over gloo).
"""

from __future__ import annotations

import torch

from ..ops import fallbacks

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EAGER_STEPS = 3   # before capture: compile (step 0), the optimizer's states (step 1), a settled allocator


def compile_units(model: torch.nn.Module) -> list[str]:
    """Compile ``model``'s blocks one by one in place (``Module.compile``: the module, its parameters
    and hooks stay what they are), and its loss head where it has one (``_head``: GPT's final
    projection and cross-entropy, far slower eager); the embeddings and final norm stay eager.
    A model without blocks is compiled whole. Returns what was compiled."""
    fallbacks.declare()
    blocks = getattr(model, "blocks", None)
    if not (isinstance(blocks, torch.nn.ModuleList) and len(blocks)):
        model.compile()
        return ["the whole model (no blocks: its gradients come at the end of backward)"]
    for b in blocks:
        b.compile()
    units = [f"{len(blocks)} blocks"]
    if callable(getattr(model, "_head", None)):
        model._head = torch.compile(model._head)
        units.append("the loss head")
    return units


class Buckets:
    """Parameters laid out in flat buffers, bucket after bucket.

    ``params``: the model's parameters (each once). Buckets take parameters in reverse order until
    they hold at least ``bucket_bytes`` of fp32; each bucket is padded to a multiple of ``world`` so
    that it splits into equal shards. ``spans[b] = (start, length)``; ``where[p] = (bucket, offset)``."""

    def __init__(self, params: list, world: int, bucket_bytes: float):
        for p in params:
            if p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"a flat gradient buffer needs contiguous fp32 parameters; one of shape "
                                 f"{tuple(p.shape)} is {p.dtype}{'' if p.is_contiguous() else ', not contiguous'}")
        self.params, self.world = params, world
        self.members: list[list] = []
        self.spans: list[tuple[int, int]] = []
        self.where: dict = {}
        cur, size, start = [], 0, 0
        for p in reversed(params):
            cur.append(p)
            size += p.numel()
            if size * 4 >= bucket_bytes:
                start = self._close(cur, size, start)
                cur, size = [], 0
        if cur:
            start = self._close(cur, size, start)
        self.total = start

    def _close(self, members: list, size: int, start: int) -> int:
        b = len(self.members)
        off = start
        for p in members:
            self.where[p] = (b, off)
            off += p.numel()
        length = -(-size // self.world) * self.world
        self.members.append(members)
        self.spans.append((start, length))
        return start + length

    def shard(self, b: int, rank: int) -> tuple[int, int]:
        """(start, length) of ``rank``'s shard of bucket ``b`` in the flat buffers."""
        start, length = self.spans[b]
        n = length // self.world
        return start + rank * n, n


class GraphedStep:
    """One rank's training step (see the module doc). ``step(batch, loss_fn)`` runs it: eagerly for
    the first ``EAGER_STEPS`` steps, then (``cuda_graph``, on a GPU) captured once and replayed.

    ``make_adamw(groups)`` builds the optimizer from groups ``{"params": [...], "decay": bool}``
    (matrices decayed, vectors not): the model's parameters, or under ``shard`` this rank's pieces.

    ``loss_fn(batch)`` returns the loss of this rank's rows under the step's autocast; the step
    returns it detached (a copy: a replay overwrites the graph's own output)."""

    def __init__(self, model: torch.nn.Module, make_adamw, device: torch.device, world: int, rank: int, *,
                 shard: bool = False, reduce_dtype: str = "fp32", bucket_mb: float = 25.0, cuda_graph: bool = True,
                 overlap_gather: bool = False, group=None):
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {reduce_dtype!r}")
        self.device, self.world, self.rank, self.shard, self.group = device, world, rank, shard, group
        self.reduce_dtype = REDUCE_DTYPES[reduce_dtype]
        params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        self.layout = lay = Buckets(params, world, bucket_mb * 2**20)
        self.flat_p = torch.zeros(lay.total, dtype=torch.float32, device=device)
        self.flat_g = torch.zeros_like(self.flat_p)
        with torch.no_grad():
            for p in params:
                b, off = lay.where[p]
                self.flat_p[off:off + p.numel()].copy_(p.reshape(-1))
                p.data = self.flat_p[off:off + p.numel()].view_as(p)
                # Backward accumulates into an existing .grad in place: every gradient lands in flat_g.
                p.grad = self.flat_g[off:off + p.numel()].view_as(p)
        # The bf16 copy of the gradients that is reduced (bucket by bucket), and each rank's reduced shard.
        self.wire = None if self.reduce_dtype == torch.float32 or world == 1 else \
            torch.zeros(lay.total, dtype=self.reduce_dtype, device=device)
        if shard:
            n = lay.total // world
            self.g_shard = torch.zeros(n, dtype=torch.float32, device=device)
            self.wire_shard = None if self.wire is None else torch.zeros(n, dtype=self.reduce_dtype, device=device)
        groups = self._shard_groups() if shard else [{"params": [p for p in params if p.dim() >= 2], "decay": True},
                                                      {"params": [p for p in params if p.dim() < 2], "decay": False}]
        self.opt = make_adamw([g for g in groups if g["params"]])
        self._left = [len(m) for m in lay.members]
        self._works: list = []
        self._launched: list[bool] = [False] * len(lay.members)
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)
        self.overlap_gather = overlap_gather and shard and world > 1
        self._pending: dict = {}
        self._gather_due = False
        if self.overlap_gather:
            self._gate_blocks(model)
        self.cuda_graph = cuda_graph and device.type == "cuda"
        self.steps = 0
        self.graph = self.static_batch = self.static_loss = self.side = self.capture_error = None

    # --- the optimizer's parameters ----------------------------------------------------------------------

    def _shard_groups(self) -> list[dict]:
        """This rank's pieces of each bucket's shard, as parameter groups: one piece per parameter
        that overlaps the shard, a view into the flat parameter buffer whose .grad is the matching
        view into the reduced shard. Matrices are decayed, vectors not (``make_optimizer``'s groups)."""
        lay, decay, no_decay = self.layout, [], []
        g_off = 0
        for b, members in enumerate(lay.members):
            s0, n = lay.shard(b, self.rank)
            for p in members:
                _, off = lay.where[p]
                lo, hi = max(off, s0), min(off + p.numel(), s0 + n)
                if lo >= hi:
                    continue
                piece = self.flat_p[lo:hi]
                piece.grad = self.g_shard[g_off + lo - s0:g_off + hi - s0]
                (decay if p.dim() >= 2 else no_decay).append(piece)
            g_off += n
        return [{"params": decay, "decay": True}, {"params": no_decay, "decay": False}]

    # --- the reductions -------------------------------------------------------------------------------

    def _ready(self, p) -> None:
        b, _ = self.layout.where[p]
        self._left[b] -= 1
        if self._left[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        import torch.distributed as dist
        self._launched[b] = True
        if self.world == 1:
            return
        start, length = self.layout.spans[b]
        src = self.flat_g[start:start + length]
        if self.wire is not None:
            w = self.wire[start:start + length]
            w.copy_(src)
            src = w
        if self.shard:
            n = length // self.world
            g0 = self._shard_offset(b)
            out = (self.wire_shard if self.wire is not None else self.g_shard)[g0:g0 + n]
            self._works.append(dist.reduce_scatter_tensor(out, src, group=self.group, async_op=True))
        else:
            self._works.append(dist.all_reduce(src, group=self.group, async_op=True))

    def _shard_offset(self, b: int) -> int:
        return sum(self.layout.spans[i][1] for i in range(b)) // self.world

    def _finish(self) -> None:
        """After backward: launch what no hook launched (a parameter without a gradient this step), wait
        for every reduction, and make the mean of the ranks' gradients."""
        for b, done in enumerate(self._launched):
            if not done:
                self._launch(b)
        for w in self._works:
            w.wait()
        self._works.clear()
        if self.world == 1:
            return
        if self.shard:
            if self.wire is not None:
                self.g_shard.copy_(self.wire_shard)
            self.g_shard.div_(self.world)
        else:
            if self.wire is not None:
                self.flat_g.copy_(self.wire)
            self.flat_g.div_(self.world)

    def _launch_gathers(self) -> dict:
        """ZeRO-1: every rank's updated shards back into every rank's parameters (in place: the input
        of each all-gather is this rank's shard inside its output), launched asynchronously in the
        order forward needs the buckets (the last bucket holds the first parameters); {bucket: work}."""
        import torch.distributed as dist
        works = {}
        if self.world == 1:
            return works
        for b in reversed(range(len(self.layout.members))):
            start, length = self.layout.spans[b]
            s0, n = self.layout.shard(b, self.rank)
            works[b] = dist.all_gather_into_tensor(self.flat_p[start:start + length], self.flat_p[s0:s0 + n],
                                                   group=self.group, async_op=True)
        return works

    def _gather(self) -> None:
        for w in self._launch_gathers().values():
            w.wait()

    # --- ZeRO-1's all-gathers behind the next forward (overlap_gather) --------------------------------------

    def _gate_blocks(self, model: torch.nn.Module) -> None:
        """Let forward wait for each block's parameters just before it runs the block, instead of
        waiting for every all-gather before the step starts. The model iterates its blocks in eager
        Python (the blocks themselves are compiled: a wait inside one would break its graph), so the
        wait goes into that iteration: ``model.blocks`` becomes a ModuleList whose iterator waits for
        block i's buckets before it hands block i out. The parameters registered before the first
        block (embeddings) are waited for when the step starts, those after the last block (final
        norm, head) when the iteration ends."""
        blocks = getattr(model, "blocks", None)
        if not (isinstance(blocks, torch.nn.ModuleList) and len(blocks)):
            raise ValueError("overlap_gather needs a model whose blocks are a ModuleList (model.blocks): its "
                             "forward is where the all-gathers are waited for")
        lay = self.layout
        in_blocks = {p for b in blocks for p in b.parameters()}
        first = next(i for i, p in enumerate(lay.params) if p in in_blocks)
        self._need_before = {lay.where[p][0] for p in lay.params[:first]}
        self._need_block = [{lay.where[p][0] for p in b.parameters() if p in lay.where} for b in blocks]
        self._need_after = {lay.where[p][0] for p in lay.params if p not in in_blocks} - self._need_before
        step = self

        class GatedBlocks(type(blocks)):
            def __iter__(self):
                for i, b in enumerate(super().__iter__()):
                    step._wait_gathers(step._need_block[i])
                    yield b
                step._wait_gathers(step._need_after)

        blocks.__class__ = GatedBlocks

    def _wait_gathers(self, buckets) -> None:
        for b in sorted(buckets, reverse=True):
            w = self._pending.pop(b, None)
            if w is not None:
                w.wait()

    def _flush(self) -> None:
        """Wait for every all-gather still pending (the parameters whole on every rank again)."""
        self._wait_gathers(list(self._pending))

    # --- the step ---------------------------------------------------------------------------------------

    def _body(self, batch, loss_fn) -> torch.Tensor:
        self.flat_g.zero_()
        self._left = [len(m) for m in self.layout.members]
        self._launched = [False] * len(self.layout.members)
        if self.overlap_gather and self._gather_due:
            # The last step's updated shards, gathered while this forward runs (GatedBlocks waits).
            self._pending = self._launch_gathers()
            self._gather_due = False
            self._wait_gathers(self._need_before)
        loss = loss_fn(batch)
        loss.backward()
        self._flush()   # a bucket forward did not wait for (a parameter it did not use)
        self._finish()
        self.opt.step()
        if self.shard:
            if self.overlap_gather:
                self._gather_due = True
            else:
                self._gather()
        return loss.detach()

    def step(self, batch, loss_fn) -> torch.Tensor:
        self.steps += 1
        if not self.cuda_graph:
            return self._body(batch, loss_fn)
        if self.steps <= EAGER_STEPS:
            # Eager steps on a side stream, as torch's CUDA-graph notes ask before a capture.
            if self.side is None:
                self.side = torch.cuda.Stream(self.device)
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                loss = self._body(batch, loss_fn).clone()
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            return loss
        if self.graph is None:
            if not self._capture(batch, loss_fn):
                return self._body(batch, loss_fn)
        else:
            _tree2(self.static_batch, batch, lambda dst, src: dst.copy_(src, non_blocking=True))
        self.graph.replay()
        return self.static_loss.clone()

    def _capture(self, batch, loss_fn) -> bool:
        """Capture the step (nothing runs yet). Every rank must capture, or none: a rank whose
        capture failed would run its collectives eagerly against its peers' graph. On a failure
        anywhere every rank keeps stepping eagerly, and ``capture_error`` says why."""
        self.static_batch = _tree(batch, lambda t: t.clone())
        torch.cuda.synchronize(self.device)
        graph, err, due = torch.cuda.CUDAGraph(), None, self._gather_due
        try:
            # thread_local: NCCL's watchdog thread may query its events while this thread captures.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                loss = self._body(self.static_batch, loss_fn)
        except Exception as e:   # noqa: BLE001 - agreed on below, then reported in the notes
            err = f"{type(e).__name__}: {e}"
            self._works.clear()
            self._pending.clear()
            self._gather_due = due   # nothing captured ran: the last step's gathers are still due
        ok = torch.tensor([0.0 if err else 1.0], device=self.device)
        if self.world > 1:
            import torch.distributed as dist
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if ok.item() < 1:
            self.cuda_graph = False
            self.capture_error = err or "a peer's capture failed"
            self.static_batch = None
            return False
        self.graph, self.static_loss = graph, loss
        return True

    def close(self) -> None:
        self.graph = self.static_batch = self.static_loss = self.side = None


def _tree(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: _tree(v, fn) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_tree(v, fn) for v in x)
    return x


def _tree2(dst, src, fn):
    if isinstance(dst, torch.Tensor):
        fn(dst, src)
    elif isinstance(dst, dict):
        for k in dst:
            _tree2(dst[k], src[k], fn)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _tree2(d, s, fn)
