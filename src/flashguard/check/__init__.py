"""``flashguard check``: is my model's low-precision attention at risk, and what do I switch on?

    import flashguard
    result = flashguard.check(model, batches, out="check")   # check.json, check.md, check.png
    flashguard check --model PATH [--text FILE] --out DIR     # the same from the command line

Files: ``dispatch`` (which backend torch picks per call), ``capture`` (the SDPA calls, per layer),
``steps`` (the forward and backward passes), ``fixes`` (the candidates and their switch lines),
``measure`` (the kernel's and the fixes' leans, the census), ``timing`` (the fixes' cost),
``verdict`` (the rule), ``report`` (console, check.json, check.md, check.png), ``load`` (models
and text from paths), ``command`` (the CLI), ``api`` (``check`` itself).

Importing this package imports nothing heavy (the CLI registers the command without torch);
``check`` and ``CheckResult`` load on first use.
"""
import importlib as _importlib
import sys as _sys
import types as _types

__all__ = ["check", "CheckResult"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(_importlib.import_module(".api", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(_types.ModuleType):
    """``flashguard.check`` is both this package and the function: once the package is imported,
    Python binds the attribute ``flashguard.check`` to the module, so the module calls ``check``."""

    def __call__(self, *args, **kwargs):
        return _importlib.import_module(".api", __name__).check(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
