"""kda_ref: the float64 oracle of Kimi Delta Attention (KDA) forward kernels.

Forms: ``recurrence`` (the definition), ``workspace`` (FlashKDA's buffers), ``chunked``
(chunk steps from the workspace), ``segments`` (passes A, B, C), ``fla_form`` (fla's
intermediates), ``mp_ref`` (mpmath) and ``numpy_ref`` (plain NumPy).  ``truth`` puts them
behind one call.  ``problems`` is the project's one problem generator (``ProblemSpec``, ``generate``).  (Functions named like their module, e.g. ``recurrence.recurrence`` and
``workspace.workspace``, are imported from the module so the module stays reachable.)
"""
from .paged import paged_read, paged_write  # noqa: F401
from .preprocess import Prepared, prepare  # noqa: F401
from .problem import Problem, ProblemError, validate  # noqa: F401
from .problems import ProblemSpec, generate  # noqa: F401
from .segments import segment_plan, segmented  # noqa: F401
from .truth import Truth, truth  # noqa: F401
from .workspace import Workspace  # noqa: F401
