"""hwlib: measure what GPU training optimizations really buy, on your own GPU.

Layers import one way (a test checks it): base (paths, device, precision, bench, results, profiles)
-> core (ops, workloads, steps, data, ceilings) -> runners (ladder, studies, memory) -> edge (query,
report, seeds, notebook, cli). Data flows notebook parameters -> runners -> bench -> results ->
query -> report.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # hwlib.audit(model, optimizer, loader) without importing torch on ``import hwlib``
    if name == "audit":
        import importlib
        return importlib.import_module(".seeds.audit", __name__)
    raise AttributeError(f"module 'hwlib' has no attribute {name!r}")
