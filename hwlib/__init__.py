"""hwlib: measure what GPU training optimizations really buy, on your own GPU.

Data flows one way: notebook parameters -> ``train`` -> ``bench`` -> ``results`` -> ``report``.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # hwlib.audit(model, optimizer, loader) without importing torch on ``import hwlib``
    if name == "audit":
        import importlib
        return importlib.import_module(".audit", __name__)
    raise AttributeError(f"module 'hwlib' has no attribute {name!r}")
