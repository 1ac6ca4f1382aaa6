"""hwlib: measure what GPU training optimizations really buy, on your own GPU.

Data flows one way: notebook parameters -> ``train`` -> ``bench`` -> ``results`` -> ``report``.
"""

__version__ = "0.1.0"

from . import audit  # noqa: E402  (hwlib.audit(model, optimizer, loader) is callable)
