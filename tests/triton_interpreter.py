"""Triton's interpreter without its repeated patching: the tests run every Triton kernel interpreted on a
CPU (conftest.py), and about half of that time went to one redundant step.

A launch patches the language modules its kernel sees (``triton.language``, ``triton.language.core``) for
its duration. Each call of a ``@triton.jit`` helper from inside the kernel then patches them again:
``_patch_lang`` walks every member of those modules and classes (``inspect.getmembers``) to find builtins
left to patch, and finds none, since the launch patched them all. BK-Core's chunked forward calls its
helpers about 1,200 times per launch: 2.3 of its 4.8 s went to that walk.

``install()`` skips a helper's patching while a launch is running that has already patched every language
module the helper sees; anything else (a helper that sees a module the kernel does not, a call outside a
launch) goes through Triton's own ``_patch_lang`` as before. It changes nothing a kernel computes: the
helpers run under the same patched modules. Where Triton's interpreter lacks these internals (another
release), nothing is changed.
"""

from __future__ import annotations

import inspect
import threading


def install() -> bool:
    """Patch Triton's interpreter as above (once); False where its internals are not those expected."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
        real_patch, real_call = interp._patch_lang, interp.GridExecutor.__call__
        empty_scope = interp._LangPatchScope
    except (ImportError, AttributeError):
        return False
    if getattr(real_patch, "_hwlib_skips_repeats", False):
        return True
    state = threading.local()    # the language modules patched by each running launch, innermost last
    langs_of: dict = {}          # a function -> the ids of the language modules its globals hold

    def langs(fn) -> frozenset:
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and (v is tl or v is tl.core))
        return langs_of[fn]

    def patch_lang(fn):
        running = getattr(state, "launches", None)
        if not running:
            return real_patch(fn)
        if running[-1] is not None and langs(fn) <= running[-1]:
            return empty_scope()          # a helper inside the launch: its modules are patched already
        scope = real_patch(fn)
        if running[-1] is None:           # the launch's own patching, restored when it ends
            running[-1] = langs(fn)
        return scope

    def call(self, *args, **kwargs):
        if not hasattr(state, "launches"):
            state.launches = []
        state.launches.append(None)
        try:
            return real_call(self, *args, **kwargs)
        finally:
            state.launches.pop()

    patch_lang._hwlib_skips_repeats = True
    interp._patch_lang, interp.GridExecutor.__call__ = patch_lang, call
    return True
