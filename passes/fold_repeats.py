"""Placeholder: replaced below."""
import contextlib
class _NoFold:
    def expand(self, gm, signature, info):
        return gm
@contextlib.contextmanager
def folded_repeats(model, enabled=True):
    yield _NoFold()
