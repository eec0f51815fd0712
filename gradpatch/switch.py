"""Whether ``GRADPATCH`` asks for gradpatch. Imports only ``os``: read by the package's face at import,
by the start-up entry, the variable parser and the command line."""
import os

#: The values of ``GRADPATCH`` (stripped, any case) that mean off, everywhere: the variable parser,
#: the start-up entry and the package's check. ``startup/gradpatch.pth`` spells the same tuple out so
#: that it imports nothing when gradpatch is off (a test checks that they agree).
OFF = ("", "0", "false", "no", "off")


def enabled() -> bool:
    return os.environ.get("GRADPATCH", "").strip().lower() not in OFF
