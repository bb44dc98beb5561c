"""kda_ref: the float64 oracle of Kimi Delta Attention (KDA) forward kernels."""
from .problem import Problem, ProblemError, validate  # noqa: F401
from .truth import Truth, truth  # noqa: F401
