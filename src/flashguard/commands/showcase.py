"""``flashguard showcase``: the first look (seconds)."""
from __future__ import annotations

from .common import wrap

NAME, OVERRIDES = "showcase", False


def add(sub, values: str):
    return sub.add_parser("showcase", help="the first look (seconds): tie-induced rounding bias per arithmetic and its fixes",
                          description=wrap("One lab problem (1,024 rows with 8 keys tied at the maximum) through the "
                                           "reference arithmetic with no fix and with the study's fix, paper-fp32fwd "
                                           "and production fa2: the lean of O and delta beyond the fp32 noise floor, "
                                           "with z. Writes nothing."))


def run(args) -> int:
    from ..experiments.showcase import run_showcase
    run_showcase()
    return 0
