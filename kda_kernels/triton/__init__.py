"""Our own FlashKDA forward in portable Triton, one module per pass, each kernel beside its
launcher: k1.py (K1, prepare: the workspace), scan.py (pass A, segment maps; pass B, segment
scan), walk.py (pass C, outputs and final state); common.py holds the JIT helpers they share,
launch.py the launch context, allocation and state views, forward.py the whole forward
(``flashkda_forward``).  kernels.py re-exports every kernel."""
from .forward import FlashKDAError, ForwardResult, flashkda_forward  # noqa: F401
from .routes import RouteError, RouteSpec, parse_route, route_names  # noqa: F401
