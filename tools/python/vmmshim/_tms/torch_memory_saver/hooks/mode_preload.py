"""configure_subprocess(): children started inside it run under the shim and import this stand-in."""
from vmmshim._saver import subprocess_env as configure_subprocess  # noqa: F401
