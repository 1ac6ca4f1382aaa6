"""The Polychromic trainer: LoRA fine-tuning with a diversity bonus every ``every``-th step.

One trainer step: ``accum`` micro-batches of ``batch`` x ``seq_len`` tokens, forward and backward
(gradient checkpointing on), then AdamW on the LoRA parameters. On a bonus step the seed computed

    loss = CE - lam * score,    score = mean over prompts of D_p, a Python float (``.item()``)

so the bonus is a constant: it shifts the loss and leaves every gradient as it was
(``seed_objective_grads`` shows it bit for bit). ``pg_loss`` is a form with a gradient: the score
as a reward on the sampled replies' log-probabilities, with a per-prompt baseline (REINFORCE):

    r_pi = (1 / (N - 1)) sum_{j != i} (1 - e_pi . e_pj) = 1 - (e_pi . s_p - 1) / (N - 1)
    b_p  = mean_i r_pi = D_p
    L_pg = -lam * mean_{p,i} (r_pi - b_p) * log pi(reply_pi | prompt_p)

The bonus itself runs in phases the notebook times apart: generation, the text round trip (token
ids to text, text to encoder ids), encoding, score.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from ...data import text as textdata
from ...ops import diversity as dv
from .build import add_lora, build_encoder, build_lm, lora_parameters, mean_pool
from .config import PolyConfig, check_config
from .decode import OwnDecodeLoop, generate

PHASES = ("training", "generation", "round_trip", "encoding", "score")


class Trainer:
    """The LM with LoRA, the encoder, the tokenizer, the data and an AdamW; ``reset`` returns the
    LoRA weights and optimizer to their start so every ladder step trains from the same state."""

    def __init__(self, cfg: PolyConfig, device, seed: int = 0, tokenizer=None):
        check_config(cfg)
        self.cfg, self.device, self.seed = cfg, torch.device(device), seed
        self.tok = tokenizer or textdata.train_tokenizer(cfg.tok_vocab, seed=seed)
        if self.tok.get_vocab_size() > cfg.vocab:
            raise ValueError(f"tokenizer: {self.tok.get_vocab_size()} ids do not fit the LM's vocab {cfg.vocab}")
        self.enc_tok = copy.deepcopy(self.tok)
        self.enc_tok.enable_padding(pad_id=textdata.PAD, pad_token="[PAD]")
        self.enc_tok.enable_truncation(max_length=cfg.enc_max_len)
        from tokenizers import processors
        self.enc_tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", textdata.CLS), ("[SEP]", textdata.SEP)])
        self.lm = add_lora(build_lm(cfg, self.device, seed), cfg, seed)
        self.encoder = build_encoder(cfg, self.device, seed)
        self.params = [p for _, p in lora_parameters(self.lm)]
        self._start = [p.detach().clone() for p in self.params]
        self._stream = self._token_stream(seed)
        self.prompts = self._prompts()
        self.loops: dict = {}
        self._compiled = self._compiled_lm = None
        self.reset()

    # --- data --------------------------------------------------------------------------------------
    def _token_stream(self, seed: int) -> torch.Tensor:
        cfg = self.cfg
        need = (cfg.accum * cfg.batch * (cfg.seq_len + 1)) * 4 + cfg.prompts * cfg.prompt_len
        lines = textdata.synthetic_corpus(max(64, need // 12), seed=seed + 1)
        ids = [i for e in self.tok.encode_batch(lines) for i in e.ids]
        while len(ids) < need:
            ids = ids + ids
        return torch.tensor(ids, dtype=torch.long)

    def _prompts(self) -> torch.Tensor:
        cfg = self.cfg
        s = self._stream[-cfg.prompts * cfg.prompt_len:]     # held apart from the training windows
        return s.view(cfg.prompts, cfg.prompt_len).to(self.device)

    def micro_batch(self, step: int, micro: int) -> torch.Tensor:
        """[batch, seq_len + 1] token windows, the same for a given (step, micro) on every way."""
        cfg = self.cfg
        n = len(self._stream) - cfg.prompts * cfg.prompt_len - cfg.seq_len - 1
        g = np.random.default_rng([self.seed, step, micro])
        starts = g.integers(0, n, size=cfg.batch)
        return torch.stack([self._stream[s:s + cfg.seq_len] for s in starts]).to(self.device, non_blocking=True)

    def reset(self) -> None:
        with torch.no_grad():
            for p, p0 in zip(self.params, self._start):
                p.copy_(p0)
        self.opt = torch.optim.AdamW(self.params, lr=self.cfg.lr)
        self.lm.train()

    def snapshot(self) -> dict:
        """The trained state (LoRA weights and AdamW's moments and step counts), copied."""
        return {"params": [p.detach().clone() for p in self.params],
                "opt": copy.deepcopy(self.opt.state_dict())}

    def restore(self, snap: dict) -> None:
        """Back to ``snap`` exactly; the snapshot stays as it was (AdamW's load_state_dict keeps the
        tensors it is given when device and dtype match, and its steps would update them in place)."""
        with torch.no_grad():
            for p, p0 in zip(self.params, snap["params"]):
                p.copy_(p0)
        self.opt = torch.optim.AdamW(self.params, lr=self.cfg.lr)
        self.opt.load_state_dict(copy.deepcopy(snap["opt"]))
        self.lm.train()

    # --- training -----------------------------------------------------------------------------------
    def ce(self, x: torch.Tensor) -> torch.Tensor:
        lm = self.lm if self._compiled is None else self._compiled
        return lm(input_ids=x, labels=x, use_cache=False).loss

    def compile_training(self, on: bool, backend: str = "inductor") -> None:
        """Train through ``torch.compile`` of the LM (LoRA and gradient checkpointing as they are) or
        eagerly. The eager step launches some 6,500 kernels a micro-batch from Python (peft's three
        matmuls per adapted projection, fp32 RMSNorm pieces): on an H200 the GPU was busy 16% of a
        0.6B step. The compiled form is built once (with ``backend``) and kept; generation never goes
        through it."""
        if on and self._compiled_lm is None:
            # the LoRA layers live inside the base model: compiling it compiles them (peft's wrapper
            # itself is not a module dynamo can take whole)
            self._compiled_lm = torch.compile(self.lm.get_base_model(), backend=backend)
        self._compiled = self._compiled_lm if on else None

    def train_step(self, step: int, bonus: float | None = None) -> torch.Tensor:
        """One optimizer step over ``accum`` micro-batches; ``bonus`` (a float) enters the loss as
        the seed's did. Returns the step's mean CE (quality loss) on the device: no sync."""
        cfg = self.cfg
        total = torch.zeros((), device=self.device)
        for m in range(cfg.accum):
            ce = self.ce(self.micro_batch(step, m))
            loss = ce if bonus is None else ce - cfg.lam * bonus
            (loss / cfg.accum).backward()
            total += ce.detach() / cfg.accum
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    # --- the bonus, phase by phase ------------------------------------------------------------------
    def loop(self) -> OwnDecodeLoop:
        """The lab's decode loop for this trainer's P N rows (built once: its graphs are reused)."""
        cfg = self.cfg
        key = (cfg.prompts * cfg.replies, cfg.prompt_len + cfg.new_tokens)
        if key not in self.loops:
            self.loops[key] = OwnDecodeLoop(self.lm, cfg, key[0], key[1], self.device)
        return self.loops[key]

    def generate(self, way: str, *, greedy: bool = False, new_tokens: int | None = None,
                 prompts: torch.Tensor | None = None, loop=None) -> torch.Tensor:
        """Replies by ``way`` (``decode.generate``); ``loop``: the decoder of way "fused" (the
        trainer's own ``OwnDecodeLoop`` serves "static_own")."""
        if loop is None and way == "static_own":
            loop = self.loop()
        return generate(way, self.lm, self.prompts if prompts is None else prompts, self.cfg, greedy=greedy,
                        new_tokens=new_tokens, loop=loop)

    def round_trip(self, replies: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [..., T] to text, text to padded encoder ids and mask [R, L] on the device.
        An empty reply (nothing left once padding and special tokens are dropped) is refused."""
        flat = replies.reshape(-1, replies.shape[-1]).tolist()
        texts = textdata.decode(self.tok, flat)
        empty = [k for k, t in enumerate(texts) if not t.strip()]
        if empty:
            raise ValueError(f"replies: reply {empty[0]} (of {len(texts)}) is empty once padding and special tokens "
                             f"are dropped: no text to embed")
        enc = self.enc_tok.encode_batch(texts)     # [CLS] text [SEP], padded to the longest, truncated
        ids = torch.tensor([e.ids for e in enc], dtype=torch.long)
        mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.long)
        return ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)

    @torch.no_grad()
    def encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Unit sentence embeddings [R, enc_hidden]: encoder, mean pooling, L2 norm."""
        return mean_pool(self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state, mask)

    # --- the objectives -----------------------------------------------------------------------------
    def reply_logprobs(self, replies: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """log pi(reply | prompt) per reply, [P, N], differentiable in the LoRA weights."""
        prompts = self.prompts if prompts is None else prompts
        P, N, T = replies.shape
        L = prompts.shape[1]
        seq = torch.cat([prompts.repeat_interleave(N, 0), replies.reshape(P * N, T)], dim=1)
        logits = self.lm(input_ids=seq, use_cache=False).logits[:, L - 1:-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, seq[:, L:, None]).squeeze(-1)
        return lp.sum(-1).view(P, N)

    def pg_loss(self, replies: torch.Tensor, emb: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """-lam * mean (r - b) log pi: the diversity score as a reward with a baseline (docstring)."""
        adv = advantages(emb)
        return -self.cfg.lam * (adv * self.reply_logprobs(replies, prompts)).mean()


def rewards(emb: torch.Tensor) -> torch.Tensor:
    """Leave-one-out reward of each reply, its mean cosine distance to the other N - 1: [P, N]."""
    dv.check_embeddings(emb)
    N = emb.shape[1]
    s = emb.sum(1, keepdim=True)
    return 1.0 - ((emb * s).sum(-1) - 1.0) / (N - 1)


def advantages(emb: torch.Tensor) -> torch.Tensor:
    """Reward minus the per-prompt baseline (the mean reward, which equals D_p), no gradient."""
    r = rewards(emb.detach())
    return r - r.mean(1, keepdim=True)


def seed_objective_grads(tr: Trainer, lam: float, score: float, step: int = 0) -> list[torch.Tensor]:
    """Gradients of the LoRA weights under the seed's objective, CE - lam * score (score a float),
    for one micro-batch."""
    for p in tr.params:
        p.grad = None
    x = tr.micro_batch(step, 0)
    loss = tr.ce(x) - lam * float(score)
    loss.backward()
    grads = [p.grad.detach().clone() for p in tr.params]
    for p in tr.params:
        p.grad = None
    return grads


def pg_reference_grads(tr: Trainer, replies: torch.Tensor, emb: torch.Tensor,
                       prompts: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The policy-gradient term's gradient computed another way, in float64: a float64 copy of the
    model, one reply at a time, log pi(reply) as the sum of each token's log-softmax, the weighted
    sum of their gradients. Small models only (a float64 copy of the whole model)."""
    prompts = tr.prompts if prompts is None else prompts
    model = copy.deepcopy(tr.lm).double()
    params = [p for _, p in lora_parameters(model)]
    adv = advantages(emb.double())
    P, N, T = replies.shape
    grads = [torch.zeros_like(p) for p in params]
    for p in range(P):
        for i in range(N):
            seq = torch.cat([prompts[p], replies[p, i]])[None]
            logits = model(input_ids=seq, use_cache=False).logits[0].double()
            lp = sum(torch.log_softmax(logits[prompts.shape[1] - 1 + t], -1)[replies[p, i, t]] for t in range(T))
            g = torch.autograd.grad(lp, params)
            for acc, gi in zip(grads, g):
                acc -= tr.cfg.lam * float(adv[p, i]) / (P * N) * gi
    return grads
