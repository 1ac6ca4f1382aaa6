"""The CUDA BK-Core (``kernels/bk_core.cu``): its torch binding and Python face.

The ``.cu`` file is plain CUDA with ``extern "C"`` launchers on raw pointers; the binding below
checks tensors, allocates the output and the tile-boundary workspace (empty unless a sequence is
longer than one tile), and launches on torch's current stream. ``hwlib.ops.build.load`` builds both.
Bytes and FLOPs per element are in the ``.cu`` header.
"""

from __future__ import annotations

import torch

BINDING = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" {
long long bk_core_workspace_elems(long long B, long long N, int is_double, int backward);
const char* bk_core_error_string(int code);
int bk_core_forward_f32(const float*, const float*, const float*, float*, float*, long long, long long,
                        double, double, void*);
int bk_core_forward_f64(const double*, const double*, const double*, double*, double*, long long, long long,
                        double, double, void*);
int bk_core_backward_f32(const float*, const float*, const float*, const float*, float*, float*, float*, float*,
                         long long, long long, double, double, void*);
int bk_core_backward_f64(const double*, const double*, const double*, const double*, double*, double*, double*,
                         double*, long long, long long, double, double, void*);
}

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

FUNCTIONS = ["bk_forward", "bk_backward"]


_MODULE = None


def module():
    """The built extension, loaded once per process (the loader's availability checks run a
    subprocess, too slow for every call); raises hwlib.device.Unavailable where it cannot be built."""
    global _MODULE
    if _MODULE is None:
        from hwlib.ops import build as cuda
        _MODULE = cuda.load("bk_core", BINDING, FUNCTIONS)
    return _MODULE


def forward(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z) -> torch.Tensor:
    z = complex(z)
    return module().bk_forward(a, b, c, z.real, z.imag)


def backward(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z, grad: torch.Tensor):
    z = complex(z)
    return tuple(module().bk_backward(a, b, c, grad, z.real, z.imag))
