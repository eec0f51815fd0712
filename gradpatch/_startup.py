"""Run at interpreter start by ``gradpatch.pth`` (or, on Python 3.15+, ``gradpatch.start``).

``main`` returns at once unless ``GRADPATCH`` is set to something other than an off value, and never
stops the interpreter from starting: every problem becomes a warning (shown, never raised, even under
``-W error``: a bad value must not leave the program running unpatched with a traceback from site.py),
except in strict mode, where the process exits with the message.
"""
import os

done = False  # read by the package (gradpatch.__init__): whether the start-up entry ran


def main() -> None:
    global done
    from gradpatch.switch import enabled as _enabled

    if done or not _enabled():
        return
    done = True  # the .pth line and a .start entry may both call this
    import warnings

    from gradpatch import environment
    from gradpatch.errors import GradpatchWarning, StartupWarning

    with warnings.catch_warnings():
        if any(action == "error" for action, *_ in warnings.filters):
            warnings.filterwarnings("default", category=GradpatchWarning)
        try:
            activate_from_env()
        except Exception as exc:
            if environment.read().strict:
                # site.py would print this as "Error processing line 1" and run the program anyway;
                # strict mode means the program must not run unpatched.
                import sys

                sys.stderr.write(f"gradpatch (GRADPATCH_STRICT=1): {exc}; not starting\n")
                sys.stderr.flush()
                os._exit(1)
            warnings.warn(f"gradpatch: start-up activation failed: {exc!r}", StartupWarning, stacklevel=2)


def activate_from_env() -> object:
    """Apply what the ``GRADPATCH*`` environment variables ask for; return the report (None when
    ``GRADPATCH`` selects nothing)."""
    from gradpatch import environment, settings
    from gradpatch.patching.activation import apply
    from gradpatch.errors import ConfigWarning, complain, logger

    env = environment.read()
    if env.log_level is not None:
        _configure_logging(env.log_level)
    if not env.enabled:  # GRADPATCH names nothing (","): its problems are all that is said
        with settings.scope(strict=env.strict):
            for problem in env.problems:
                complain(ConfigWarning, problem, once=True)
        return None
    report = apply()
    waiting = len(report.by_status("deferred"))
    logger.info("active (GRADPATCH=%s): %d applied, %d waiting for their targets to be imported",
                os.environ.get("GRADPATCH", ""), len(report.by_status("applied")), waiting)
    return report


def _configure_logging(level: int) -> None:
    import logging

    from gradpatch.errors import logger

    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("gradpatch: %(message)s"))
        logger.addHandler(handler)
