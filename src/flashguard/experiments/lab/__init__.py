"""The rounding-bias lab: controlled attention problems, measured against fp64."""
from .experiments import FORMAT_POLICIES, STABILIZER_SET, run_lab
from .measure import Measurement, measure
from .problems import Problem, make_problem
from .stats import ErrorStats, error_stats, sign_test_p

__all__ = ["run_lab", "measure", "Measurement", "Problem", "make_problem", "ErrorStats", "error_stats",
           "sign_test_p", "STABILIZER_SET", "FORMAT_POLICIES"]
