"""``fp8lab quantize``, ``fp8lab inspect`` and ``fp8lab make-tiny`` (not written yet)."""


def register(subparsers) -> None:
    """Add this module's subcommands to the ``fp8lab`` parser."""
