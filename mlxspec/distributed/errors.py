"""The failures of a distributed run the user must see as one clear line."""


class DistributedError(RuntimeError):
    """A sharded run that cannot go on (bad rank count, diverged rank, mismatched weights)."""
