"""``fp8lab generate`` (not written yet)."""


def register(subparsers) -> None:
    """Add this module's subcommands to the ``fp8lab`` parser."""
