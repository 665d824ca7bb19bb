"""The engine's typed errors.

Three tiers (docs/design.md): `assert` for our own invariants; `InvalidRequestError` for a caller's
mistake (one request is rejected, the engine keeps serving); `ConfigError` for an operator's
mistake (the process refuses to start, with the numbers and the remedy).
"""


class SplitserveError(Exception):
    """Base class of every error splitserve raises on purpose."""


class InvalidRequestError(SplitserveError, ValueError):
    """A request is malformed: says which value was wrong and what is allowed."""


class ConfigError(SplitserveError, ValueError):
    """A deployment setting cannot work: says the numbers and how to fix it."""


class UnsupportedModelError(ConfigError):
    """The weights use an architecture or tensor type the engine does not implement."""


class TensorParallelError(SplitserveError, RuntimeError):
    """A rank of the engine's tensor-parallel group died, stopped or failed: the group is down
    (every rank ended) and the engine cannot step again."""
