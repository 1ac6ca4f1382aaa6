"""The CUDA BK-Core (``kernels/12_bk_core.cu``): its torch binding and Python face.

The ``.cu`` file is plain CUDA with ``extern "C"`` launchers on raw pointers, declared once in
``12_bk_core.h``. The torch binding below includes that header (the compiler holds its calls to the
declarations), checks tensors, allocates the output and the tile-boundary workspace (empty unless a
sequence is longer than one tile), and launches on torch's current stream; ``hwlib.ops.build.load``
builds both. ``prototypes()`` reads the header for Python: ``bind_ctypes`` declares the host
launchers to ctypes from it, and ``check_binding`` checks the binding's calls against it (a test
runs it on every machine, GPU or not). Bytes and FLOPs per element are in the ``.cu`` header.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

import torch

from .sources import read_kernel_source

HEADER = "12_bk_core.h"

WRAPPER = r"""
static void check_abc(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && c.is_cuda(), "bk_core (cuda): diag, upper, lower must be CUDA tensors");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2, "bk_core (cuda): expected [B, N] and [B, N-1]");
  TORCH_CHECK(b.size(0) == a.size(0) && c.size(0) == a.size(0) && b.size(1) == a.size(1) - 1 &&
              c.size(1) == a.size(1) - 1, "bk_core (cuda): upper/lower must be [B, N-1]");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.scalar_type() == c.scalar_type() &&
              (a.scalar_type() == torch::kFloat || a.scalar_type() == torch::kDouble),
              "bk_core (cuda): float32 or float64, all three the same");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && c.is_contiguous(), "bk_core (cuda): contiguous inputs");
  TORCH_CHECK(b.device() == a.device() && c.device() == a.device(), "bk_core (cuda): one device");
}

torch::Tensor bk_forward(torch::Tensor a, torch::Tensor b, torch::Tensor c, double zr, double zi) {
  check_abc(a, b, c);
  const c10::cuda::CUDAGuard guard(a.device());
  const long long B = a.size(0), N = a.size(1);
  const bool dbl = a.scalar_type() == torch::kDouble;
  auto out = torch::empty({B, N}, a.options().dtype(dbl ? torch::kComplexDouble : torch::kComplexFloat));
  auto ws = torch::empty({bk_core_workspace_elems(B, N, dbl, 0) + 1}, a.options());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  const int err = dbl
      ? bk_core_forward_f64(a.data_ptr<double>(), b.data_ptr<double>(), c.data_ptr<double>(),
                            reinterpret_cast<double*>(out.data_ptr()), ws.data_ptr<double>(), B, N, zr, zi, stream)
      : bk_core_forward_f32(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(),
                            reinterpret_cast<float*>(out.data_ptr()), ws.data_ptr<float>(), B, N, zr, zi, stream);
  TORCH_CHECK(err == 0, "bk_core forward launch failed: ", bk_core_error_string(err));
  return out;
}

std::vector<torch::Tensor> bk_backward(torch::Tensor a, torch::Tensor b, torch::Tensor c, torch::Tensor grad,
                                       double zr, double zi) {
  check_abc(a, b, c);
  const c10::cuda::CUDAGuard guard(a.device());
  const long long B = a.size(0), N = a.size(1);
  const bool dbl = a.scalar_type() == torch::kDouble;
  auto w = grad.to(dbl ? torch::kComplexDouble : torch::kComplexFloat).contiguous();
  TORCH_CHECK(w.device() == a.device() && w.size(0) == B && w.size(1) == N, "bk_core (cuda): grad must be [B, N]");
  auto ga = torch::empty_like(a), gb = torch::empty_like(b), gc = torch::empty_like(c);
  auto ws = torch::empty({bk_core_workspace_elems(B, N, dbl, 1) + 1}, a.options());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  const int err = dbl
      ? bk_core_backward_f64(a.data_ptr<double>(), b.data_ptr<double>(), c.data_ptr<double>(),
                             reinterpret_cast<const double*>(w.data_ptr()), ga.data_ptr<double>(),
                             gb.data_ptr<double>(), gc.data_ptr<double>(), ws.data_ptr<double>(), B, N, zr, zi, stream)
      : bk_core_backward_f32(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(),
                             reinterpret_cast<const float*>(w.data_ptr()), ga.data_ptr<float>(),
                             gb.data_ptr<float>(), gc.data_ptr<float>(), ws.data_ptr<float>(), B, N, zr, zi, stream);
  TORCH_CHECK(err == 0, "bk_core backward launch failed: ", bk_core_error_string(err));
  return {ga, gb, gc};
}
"""

BINDING = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "12_bk_core.h"
""" + WRAPPER

FUNCTIONS = ["bk_forward", "bk_backward"]
# What the binding calls: each must be declared in the header with the arguments passed here.
CALLED = ("bk_core_workspace_elems", "bk_core_error_string", "bk_core_forward_f32", "bk_core_forward_f64",
          "bk_core_backward_f32", "bk_core_backward_f64")


# --- the header, read for Python -----------------------------------------------------------------

@dataclass(frozen=True)
class Prototype:
    """One ``extern "C"`` launcher: its name, return type and parameter types (names dropped)."""

    name: str
    restype: str
    params: tuple[str, ...]


_TYPE_WORDS = {"const", "void", "char", "int", "long", "float", "double", "unsigned", "signed", "short"}
_DECL = re.compile(r"((?:\b(?:%s)\b\s*\**\s*)+)\b(bk_core_\w+)\s*\(([^()]*)\)\s*([;{])" % "|".join(_TYPE_WORDS))
_CTYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "double": ctypes.c_double,
           "const char*": ctypes.c_char_p}


def _strip_comments(text: str) -> str:
    """C source without comments and preprocessor lines."""
    return re.sub(r"//[^\n]*|/\*.*?\*/|^\s*#[^\n]*", " ", text, flags=re.S | re.M)


def _ctype(decl: str) -> str:
    """'const float* a' -> 'const float*', 'long long B' -> 'long long' (the parameter's name dropped)."""
    words = decl.replace("*", " * ").split()
    if len(words) > 1 and words[-1] != "*" and words[-1] not in _TYPE_WORDS:
        words = words[:-1]
    return " ".join(words).replace(" *", "*")


def parse_prototypes(text: str, *, definitions: bool = False) -> dict[str, Prototype]:
    """The ``bk_core_*`` declarations of C source ``text`` (``definitions``: the function bodies'
    signatures instead, as a ``.cu`` file writes them). A name declared twice is an error."""
    out = {}
    for m in _DECL.finditer(_strip_comments(text)):
        if (m.group(4) == "{") != definitions:
            continue
        params = tuple(_ctype(p) for p in m.group(3).split(",") if p.strip())
        if params == ("void",):
            params = ()
        name = m.group(2)
        if name in out:
            raise ValueError(f"{name} is declared twice")
        out[name] = Prototype(name, _ctype(m.group(1)), params)
    return out


def prototypes() -> dict[str, Prototype]:
    """The launchers as ``kernels/12_bk_core.h`` declares them."""
    return parse_prototypes(read_kernel_source(HEADER))


def _call_args(text: str, start: int) -> list[str]:
    """The top-level arguments of the call whose '(' is at ``text[start]``."""
    depth, args, cur = 0, [], []
    for ch in text[start:]:
        if ch in "([{":
            depth += 1
            if depth == 1:
                continue
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append("".join(cur))
                break
        elif ch == "," and depth == 1:
            args.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    return [a.strip() for a in args if a.strip()]


def binding_calls(wrapper: str = WRAPPER) -> dict[str, list[int]]:
    """{launcher: the number of arguments at each of its call sites} in the binding's C++."""
    calls: dict[str, list[int]] = {}
    code = _strip_comments(wrapper)
    for m in re.finditer(r"\b(bk_core_\w+)\s*\(", code):
        calls.setdefault(m.group(1), []).append(len(_call_args(code, m.end() - 1)))
    return calls


def check_binding(protos: dict[str, Prototype] | None = None, wrapper: str = WRAPPER) -> list[str]:
    """What in the binding disagrees with the header: launchers it needs that the header lacks, and
    calls whose argument count differs from the declaration. Empty when they agree."""
    protos = prototypes() if protos is None else protos
    calls = binding_calls(wrapper)
    problems = [f"{name}: called by the binding, not declared in {HEADER}" for name in CALLED if name not in protos]
    problems += [f"{name}: never called by the binding, which needs it" for name in CALLED if name not in calls]
    for name, counts in calls.items():
        if name not in protos:
            problems.append(f"{name}: called by the binding, not declared in {HEADER}")
            continue
        want = len(protos[name].params)
        problems += [f"{name}: called with {n} arguments, {HEADER} declares {want} "
                     f"({', '.join(protos[name].params)})" for n in counts if n != want]
    return problems


def ctypes_signature(proto: Prototype) -> tuple:
    """(restype, argtypes) for ctypes: every pointer is a c_void_p (pass tensors' data_ptr())."""
    def one(t):
        if t.endswith("*") and t != "const char*":
            return ctypes.c_void_p
        if t not in _CTYPES:
            raise ValueError(f"{proto.name}: no ctypes type for {t!r}; add it to hwlib.ops.bk_cuda._CTYPES")
        return _CTYPES[t]
    return one(proto.restype), [one(t) for t in proto.params]


def bind_ctypes(lib: ctypes.CDLL, protos: dict[str, Prototype] | None = None) -> ctypes.CDLL:
    """Declare every launcher the header names to ``lib`` (a shared library built from the .cu)."""
    for name, proto in (prototypes() if protos is None else protos).items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes_signature(proto)
    return lib


_MODULE = None


def module():
    """The built extension, loaded once per process (the loader's availability checks run a
    subprocess, too slow for every call); raises hwlib.device.Unavailable where it cannot be built."""
    global _MODULE
    if _MODULE is None:
        problems = check_binding()
        if problems:                     # a bug in this file or the header, not a missing tool
            raise RuntimeError(f"the bk_core binding disagrees with {HEADER}: " + "; ".join(problems))
        from hwlib.ops import build as cuda
        _MODULE = cuda.load("12_bk_core", BINDING, FUNCTIONS)
    return _MODULE


def forward(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z) -> torch.Tensor:
    z = complex(z)
    return module().bk_forward(a, b, c, z.real, z.imag)


def backward(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z, grad: torch.Tensor):
    z = complex(z)
    return tuple(module().bk_backward(a, b, c, grad, z.real, z.imag))
