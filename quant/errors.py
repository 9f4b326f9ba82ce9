"""The error a quantized-checkpoint reader raises; its own module so that formats.py (which finds
the format modules) and the format modules (which raise it) do not import each other.

quant/ does not import core/, so FormatError is not a BriskError: brisk's core turns it into one
where it loads a checkpoint (a FileError naming the checkpoint), as any other library's error."""


class FormatError(ValueError):
    """A quantized checkpoint this code cannot read (the message names what and why)."""
