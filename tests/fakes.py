"""hwlib's custom ops checked against their fake implementations while the real ones run."""

from __future__ import annotations


def hwlib_fakes_checked():
    """A context in which every hwlib op that runs also runs on fake tensors, and its fake outputs are
    compared with the real ones (shapes, dtypes, strides: what inductor's compiled code would assert at run
    time). The compile tests trace under aot_eager, not inductor: dynamo's and AOT autograd's side is their
    subject, inductor's C++ code generation for a CPU (which no GPU run uses) cost 6-27 s of CPU each, and
    inductor taking hwlib's ops is tests/test_fallbacks.py's subject."""
    from torch._subclasses.fake_utils import CrossRefFakeMode
    return CrossRefFakeMode(ignore_op_fn=lambda op: getattr(op, "namespace", None) != "hwlib")
