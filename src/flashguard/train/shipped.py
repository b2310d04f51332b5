"""The training configs shipped with flashguard, found by name: ``flashguard train tiny-cpu``.

They are the repository's ``configs/*.toml``, installed as package data (``flashguard/configs``,
a link to ``configs/`` in the source tree), so a regular ``pip install .`` finds them from any
folder. A path to a TOML file is used as it is.
"""
from __future__ import annotations

from pathlib import Path

from .config import ConfigError

__all__ = ["shipped_configs", "find_config", "config_precision"]

_PACKAGE = Path(__file__).resolve().parents[1]   # .../flashguard
# installed: flashguard/configs (package data); a source checkout: flashguard/configs -> ../../configs,
# or configs/ itself where the link is not a link (a checkout without symlinks)
_DIRS = (_PACKAGE / "configs", _PACKAGE.parents[1] / "configs")


def shipped_configs() -> dict[str, Path]:
    """name (file stem) -> path of every shipped config."""
    for d in _DIRS:
        if d.is_dir():
            found = {p.stem: p for p in sorted(d.glob("*.toml"))}
            if found:
                return found
    return {}


def find_config(name_or_path: str | Path) -> Path:
    """The TOML file ``name_or_path`` names: an existing file, or a shipped config's name
    (``tiny-cpu`` or ``tiny-cpu.toml``). ConfigError, listing the names, otherwise."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_configs()
    stem = path.name[:-len(".toml")] if path.name.endswith(".toml") else path.name
    if path.parent == Path(".") and stem in shipped:
        return shipped[stem]
    names = ", ".join(shipped) or "(none found: broken install?)"
    raise ConfigError(f"config {str(name_or_path)!r} is neither a file nor a shipped config; shipped: {names}")


def config_precision(path: str | Path) -> str:
    """The attention precision a config file trains ([attention] precision; the default where it
    sets none), read without validating the rest: for listings such as ``flashguard train --help``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        precision = tomllib.loads(Path(path).read_text()).get("attention", {}).get("precision")
    except (OSError, tomllib.TOMLDecodeError, AttributeError) as e:
        raise ConfigError(f"config file {path} is not readable TOML: {e}") from None
    if precision is None:
        from .config import _default_spec
        precision = _default_spec().precision
    return str(precision)
