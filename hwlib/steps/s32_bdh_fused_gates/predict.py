"""What step 32 removes: the [H, B T, N] results that the encoder's, the gate's and the decoder's
gradient's matmuls write and their elementwise kernels read back."""

from __future__ import annotations

from ...workloads.vit_bdh import TOKENS


def passes_removed() -> dict[str, int]:
    """[H, B T, N] tensor passes per layer application, unfused against fused, at one pass per tensor
    (``kernels/32_bdh_gates_triton.py`` counts them): (unfused, fused) per matmul."""
    return {"encode (forward)": (4, 2), "gate (forward)": (5, 3), "decoder's input gradient (backward)": (6, 4)}


def traffic_bytes(H: int, B: int, T: int, N: int, elem: int = 2) -> dict[str, float]:
    """Bytes of those passes per layer application: the recipe's and this step's."""
    q = H * B * T * N * elem
    p = passes_removed().values()
    return {"recipe (matmul, then elementwise)": float(q * sum(u for u, _ in p)),
            "fused epilogues": float(q * sum(f for _, f in p))}


def predict(ctx):
    c = ctx.cfg
    t = traffic_bytes(c.n_head, c.batch, TOKENS, c.n_neuron, ctx.elem)
    removed = c.n_layer * (t["recipe (matmul, then elementwise)"] - t["fused epilogues"])
    return ctx.bytes_prediction("each of three matmuls' [H, B T, N] result stays in its tile for its elementwise "
                                "work: one write and one read fewer per matmul, at one pass per tensor", removed)
