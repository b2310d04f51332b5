"""The rounding-bias lab: attention problems of independent rows, measured against fp64 and the floor."""
from .experiments import FORMAT_POLICIES, STABILIZER_SET, run_lab
from .measure import Bench, Measurement
from .problems import Problem, make_problem

__all__ = ["run_lab", "Bench", "Measurement", "Problem", "make_problem", "STABILIZER_SET", "FORMAT_POLICIES"]
