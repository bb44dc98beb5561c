"""Stand-in for ``intj``, the native-launcher package aiter's ``fast_launch`` imports.

``intj`` is not published anywhere this project can fetch it from.  aiter's
``fast_launch(kernel, use_intj=False)`` (the default, and what every FlashKDA
launcher uses) never calls it: the import alone must succeed.  Any real use raises,
naming this stub, so a path that would need the native launcher is never silently
replaced by something else.
"""


class Constexpr:
    def __init__(self, value=None):
        self.value = value


def make_launcher(*args, **kwargs):
    raise NotImplementedError(
        "intj stand-in (tools/aiter_shims/intj): the native launcher is not available; "
        "fast_launch(..., use_intj=True) cannot run with this assembled aiter tree")
