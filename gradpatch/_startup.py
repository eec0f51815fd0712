"""Run at interpreter start by ``gradpatch.pth`` (or, on Python 3.15+, ``gradpatch.start``).

``main`` returns at once unless ``GRADPATCH`` is set, and never stops the interpreter from starting:
every error becomes a warning, except in strict mode, where the process exits with the message.
"""
import os

_done = False


def main() -> None:
    global _done
    if _done or os.environ.get("GRADPATCH", "").strip() in ("", "0"):
        return
    _done = True  # the .pth line and a .start entry may both call this
    from gradpatch import settings

    try:
        from gradpatch.activation import activate_from_env

        activate_from_env()
    except Exception as exc:
        if settings.strict:
            # site.py would print this as "Error processing line 1" and run the program anyway;
            # strict mode means the program must not run unpatched.
            import sys

            sys.stderr.write(f"gradpatch (GRADPATCH_STRICT=1): {exc}; not starting\n")
            sys.stderr.flush()
            os._exit(1)
        import warnings

        from gradpatch.errors import StartupWarning

        warnings.warn(f"gradpatch: start-up activation failed: {exc!r}", StartupWarning, stacklevel=2)
