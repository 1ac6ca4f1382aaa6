"""References for the BK-Core, in one place: tests, notebooks and benchmarks import them from here.

The BK-Core (ResNet-BK) returns ``G_i = [(T - z I)^-1]_ii`` for a tridiagonal T with diagonal ``a``
([B, N]), super-diagonal ``b`` and sub-diagonal ``c`` ([B, N-1]) and ``Im z != 0``. Only the
products ``k_j = b_j c_j`` enter G. With ``d_i = a_i - z``:

    gL_i = 1 / (d_i - k_{i-1} gL_{i-1})        left to right  (gL_0 = 1 / d_0)
    gR_i = 1 / (d_i - k_i gR_{i+1})            right to left  (gR_{N-1} = 1 / d_{N-1})
    G_i  = 1 / (d_i - k_{i-1} gL_{i-1} - k_i gR_{i+1})

(the continued fractions of recursive Green's-function methods). Every quantity is a ratio, so
nothing overflows: for symmetric T and Im z != 0, ``|gL|, |gR|, |G| <= 1 / |Im z|``.

Exact gradient. With R = (T - zI)^-1, ``dG_i/da_j = -R_ij R_ji``, ``dG_i/db_j = -R_ij R_{j+1,i}``,
``dG_i/dc_j = -R_{i,j+1} R_ji``. For a real loss L and torch's incoming grad w (for real inputs
``dL/dx = Re(sum_i conj(w_i) dG_i/dx)``), the three sums are entries of ``M = R V R`` with
``V = diag(v)``, ``v = conj(w)``: ``dL/da_j = -Re M_jj``, ``dL/db_j = -Re M_{j+1,j}``,
``dL/dc_j = -Re M_{j,j+1}``. And ``M = d/de (T - zI - eV)^-1`` at e = 0: one forward-mode tangent of
the same recursions with ``d_i' = -v_i`` gives the whole band of M in O(N):

    gL_i' = gL_i^2 (v_i + k_{i-1} gL_{i-1}')     gR_i' = gR_i^2 (v_i + k_i gR_{i+1}')
    G_i'  = G_i^2 (v_i + k_{i-1} gL_{i-1}' + k_i gR_{i+1}')
    dL/da_i = -Re G_i'
    P_i = G_i' gR_{i+1} + G_i gR_{i+1}'   (from R_{i+1,i} = -c_i G_i gR_{i+1}, R_{i,i+1} = -b_i G_i gR_{i+1})
    dL/db_i = c_i Re P_i,   dL/dc_i = b_i Re P_i

``forward_loop`` / ``backward_loop`` below are that math as a plain Python loop over N (batched
over B): the readable spec every kernel is checked against. ``resolvent_diagonal_dense`` is the
float64 dense inverse, ``resolvent_diagonal_theta_phi`` the seed's determinant recursion (which
overflows; kept for the accuracy study).
"""

from __future__ import annotations

import torch

COMPLEX_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128}
REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def resolvent_diagonal_dense(diag: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, z) -> torch.Tensor:
    """diag((T - zI)^-1) by a dense complex128 inverse: O(N^3), the ground truth for small N.

    Differentiable (through ``torch.linalg.inv``), so it also checks gradients."""
    a, b, c = (x.to(torch.float64) for x in (diag, upper, lower))
    n = a.shape[-1]
    t = torch.diag_embed(a)
    if n > 1:
        t = t + torch.diag_embed(b, offset=1) + torch.diag_embed(c, offset=-1)
    eye = torch.eye(n, dtype=torch.complex128, device=a.device)
    return torch.linalg.inv(t.to(torch.complex128) - complex(z) * eye).diagonal(dim1=-2, dim2=-1)


def resolvent_diagonal_theta_phi(diag: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, z,
                                 dtype: torch.dtype = torch.complex64,
                                 division_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The seed's determinant recursion, as written there (0-based), in ``dtype``:

        theta_0 = 1, theta_1 = d_0, theta_{i+1} = d_i theta_i - k_{i-1} theta_{i-1}
        phi_{N-1} = 1, phi_{N-2} = d_{N-1}, phi_i = d_{i+1} phi_{i+1} - k_{i+1} phi_{i+2}
        G_i = theta_i phi_i / theta_N

    theta_N = det(T - zI) grows like |2.07|^N for the model's matrix (a = -2, k = 1, z = i): complex64
    turns non-finite from N ~ 123, complex128 from N ~ 952. Do not use it for anything but showing that.
    ``division_dtype`` runs the final division in another precision (the seed's "mixed precision":
    recursions in complex64, division in complex128).
    """
    if dtype not in REAL_OF:
        raise TypeError(f"dtype must be torch.complex64 or torch.complex128, got {dtype}")
    real = REAL_OF[dtype]
    a = diag.to(real)
    k = (upper.to(real) * lower.to(real)).to(dtype)
    d = a.to(dtype) - complex(z)
    n = a.shape[-1]
    one = torch.ones_like(d[..., 0])
    theta = [one, d[..., 0]]
    for i in range(1, n):
        theta.append(d[..., i] * theta[i] - k[..., i - 1] * theta[i - 1])
    phi = [None] * n
    phi[n - 1] = one
    if n >= 2:
        phi[n - 2] = d[..., n - 1]
    for i in range(n - 3, -1, -1):
        phi[i] = d[..., i + 1] * phi[i + 1] - k[..., i + 1] * phi[i + 2]
    div = division_dtype or dtype
    num = torch.stack([theta[i] * phi[i] for i in range(n)], dim=-1)
    return num.to(div) / theta[n].to(div).unsqueeze(-1)


# --- the spec: plain loops over N, batched over the leading dimension ----------------------------

def _d_k(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z):
    cd = COMPLEX_OF[a.dtype]
    return a.to(cd) - complex(z), (b * c).to(cd)


def combine_forward(d: torch.Tensor, k: torch.Tensor, gl: torch.Tensor, gr: torch.Tensor) -> torch.Tensor:
    """G_i = 1 / (d_i - k_{i-1} gL_{i-1} - k_i gR_{i+1}), vectorized over [B, N] (shared by the
    torch backends; the kernels fuse it into their right-to-left pass)."""
    s = d.clone()
    s[:, 1:] -= k * gl[:, :-1]
    s[:, :-1] -= k * gr[:, 1:]
    return 1 / s


def combine_backward(b, c, k, g, gr, v, glp, grp):
    """dL/da, dL/db, dL/dc from G, gR, the tangents gL', gR' and v = conj(grad) (module docstring)."""
    t = v.clone()
    t[:, 1:] += k * glp[:, :-1]
    t[:, :-1] += k * grp[:, 1:]
    gp = g * g * t
    p = (gp[:, :-1] * gr[:, 1:] + g[:, :-1] * grp[:, 1:]).real
    return -gp.real, c * p, b * p


def sweeps_loop(d: torch.Tensor, k: torch.Tensor):
    """gL and gR by the two continued fractions, one Python step per position."""
    n = d.shape[-1]
    gl, gr = [None] * n, [None] * n
    for i in range(n):
        gl[i] = 1 / (d[:, i] - k[:, i - 1] * gl[i - 1]) if i > 0 else 1 / d[:, 0]
    for i in range(n - 1, -1, -1):
        gr[i] = 1 / (d[:, i] - k[:, i] * gr[i + 1]) if i < n - 1 else 1 / d[:, n - 1]
    return torch.stack(gl, -1), torch.stack(gr, -1)


def forward_loop(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z) -> torch.Tensor:
    """G for a [B, N], b, c [B, N-1] (float32 or float64) -> [B, N] complex. The spec."""
    d, k = _d_k(a, b, c, z)
    gl, gr = sweeps_loop(d, k)
    return combine_forward(d, k, gl, gr)


def backward_loop(a, b, c, z, grad: torch.Tensor):
    """(dL/da, dL/db, dL/dc) for incoming grad [B, N] complex: the tangent sweeps as loops."""
    d, k = _d_k(a, b, c, z)
    gl, gr = sweeps_loop(d, k)
    g = combine_forward(d, k, gl, gr)
    # conj() only sets a bit that later ops must honour; inside a custom op that torch.compile
    # traces without autograd (hwlib::resolvent_features_backward) that bit was not applied and the
    # gradients came out wrong (torch.library.opcheck): conjugate the data itself.
    v = grad.to(d.dtype).conj().resolve_conj()
    n = d.shape[-1]
    glp, grp = [None] * n, [None] * n
    for i in range(n):
        glp[i] = gl[:, i] ** 2 * (v[:, i] + k[:, i - 1] * glp[i - 1] if i > 0 else v[:, 0])
    for i in range(n - 1, -1, -1):
        grp[i] = gr[:, i] ** 2 * (v[:, i] + k[:, i] * grp[i + 1] if i < n - 1 else v[:, n - 1])
    return combine_backward(b, c, k, g, gr, v, torch.stack(glp, -1), torch.stack(grp, -1))
