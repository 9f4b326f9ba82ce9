"""The error a quantized-checkpoint reader raises; its own module so that formats.py (which finds
the format modules) and the format modules (which raise it) do not import each other."""


class FormatError(ValueError):
    """A quantized checkpoint this code cannot read (the message names what and why)."""
