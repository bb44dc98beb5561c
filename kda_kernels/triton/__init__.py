"""Our own FlashKDA forward in portable Triton: K1 (prepare), pass A (segment maps),
pass B (segment scan), pass C (outputs and final state).  See forward.flashkda_forward."""
from .forward import FlashKDAError, ForwardResult, flashkda_forward  # noqa: F401
from .routes import RouteError, RouteSpec, parse_route, route_names  # noqa: F401
