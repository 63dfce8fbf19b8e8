"""TMS's small helpers, as its tests and callers import them."""
import contextlib
import os


def is_xpu():
    return False


@contextlib.contextmanager
def change_env(key, value):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
