"""The ``gradpatch`` command (also ``python -m gradpatch``).

``gradpatch list [CODEBASE] [--all|--wide|--json]``  the known patches: one line per codebase (how
                                      many, what they replace); CODEBASE: that codebase's patches and
                                      what each fixes; ``--all``: every patch, by codebase
``gradpatch status [--all|--wide|--json]``  whether gradpatch is active here (``GRADPATCH``, start-up
                                      file), then per upstream package installed here its version and
                                      whether its code matches a known fingerprint; ``--all``: every
                                      patch (read from source: nothing is imported, so neither torch
                                      nor any target is loaded)
``gradpatch run [OPTIONS] -- CMD``    run CMD with gradpatch active in it and every Python process it
                                      starts (sets ``GRADPATCH*`` and execs, like ``ddtrace-run``)
``gradpatch doctor SCRIPT [ARGS]``    run a training script and, after each backward, explain every
                                      parameter that requires grad but got no gradient (or say in one
                                      line that every one got a gradient)
``gradpatch tradeoff MODULE:FACTORY`` time and memory of the training step ``FACTORY()`` returns
                                      under ``respect``, budgets in MiB and ``never``, with the spread
                                      of the timings and the policy it recommends
``gradpatch --version``               this gradpatch's version and where it is imported from

Output fits 100 columns and starts with counts (``--wide``: one line per row, ``--json``: for tools).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Sequence

from gradpatch.switch import OFF as _OFF
from gradpatch.patching.fingerprint import Fingerprints, fingerprint_source
from gradpatch.cli_list import print_list
from gradpatch.patching.patch import WIDTH, Patch, elide, format_table


def _source_path(module: str) -> str | None:
    """The file of ``module`` found without importing it (or its parent packages)."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return spec.origin
    for base in spec.submodule_search_locations or ():
        stem = os.path.join(base, *rest)
        for candidate in (stem + ".py", os.path.join(stem, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def _version(patch: Patch, path: str) -> tuple[str | None, str | None]:
    """``(version, shadowed)``: the version of the distribution that ``path`` (the file a plain import
    finds) belongs to; or, when a local copy shadows an installed distribution, ``(None, what)``."""
    if not patch.requires:
        return None, None
    from importlib.metadata import PackageNotFoundError, distribution

    from gradpatch.patching.versions import split_requirement

    name = split_requirement(patch.requires)[0]
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        return None, None
    if _owns(dist, path):
        return dist.version, None
    return None, f"a local copy is imported: {path} (installed: {name} {dist.version})"


def _owns(dist: object, path: str) -> bool:
    """Whether ``path`` is one of the installed distribution's files (or under its editable source)."""
    real = os.path.realpath(path)
    root = os.path.realpath(str(dist.locate_file("")))  # type: ignore[attr-defined]
    listed = {os.path.normpath(str(f)) for f in dist.files or ()}  # type: ignore[attr-defined]
    if os.path.relpath(real, root) in listed:
        return True
    direct = dist.read_text("direct_url.json") or ""  # type: ignore[attr-defined]
    if '"editable": true' in direct.replace("'", '"'):
        url = json.loads(direct).get("url", "")
        source = os.path.realpath(url[len("file://"):]) if url.startswith("file://") else ""
        return bool(source) and real.startswith(source + os.sep)
    return False


def _status(patch: Patch) -> dict[str, object]:
    path = _source_path(patch.module)
    version, shadowed = _version(patch, path) if path else (None, None)
    row: dict[str, object] = {"patch": patch.name, "target": patch.target, "installed": path is not None,
                              "version": version, "path": path, "shadowed": shadowed, "code": "not installed"}
    recogniser = patch.recognise
    if path is None:
        return row
    if not isinstance(recogniser, Fingerprints):
        row["code"] = "checked when imported"
        return row
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            digest = fingerprint_source(handle.read(), recogniser.over or (patch.qualname,))
    except (OSError, SyntaxError, LookupError) as exc:
        row["code"] = f"unreadable ({exc})"
        return row
    if digest in recogniser.known:
        row["code"] = f"known: {recogniser.known[digest]}"
    elif digest in recogniser.fixed:
        row["code"] = f"fixed upstream: {recogniser.fixed[digest]}"
    else:
        row["code"] = f"unknown fingerprint {digest}"
    return row


def _print_status(args: argparse.Namespace) -> int:
    from gradpatch.patching.activation import known_patches

    patches = list(known_patches().values())
    statuses = [_status(p) for p in patches]
    if args.json:
        print(json.dumps(statuses, indent=2))
        return 0
    import gradpatch
    from gradpatch.cli_status import activity_line, summary_lines

    print(activity_line(width=WIDTH))
    if not (args.all or args.wide):
        heading = f"gradpatch {gradpatch.__version__} from "
        print(heading + elide(os.path.dirname(gradpatch.__file__), WIDTH - len(heading)))
        for line in summary_lines(statuses, {p.name: p.upstream for p in patches}):
            print(line)
        print("every patch: gradpatch status --all (or --wide, --json)")
        return 0

    heading = f"gradpatch {gradpatch.__version__} from "
    print(heading + elide(os.path.dirname(gradpatch.__file__), WIDTH - len(heading)))
    rows: list[tuple[str, ...]] = [("patch", "version", "target", "code") if args.wide
                                   else ("patch", "version", "code")]
    for s in statuses:
        code = str(s["code"]) + (f"; {s['shadowed']}" if s["shadowed"] else "")
        version = str(s["version"] or ("local copy" if s["shadowed"] else "-"))
        rows.append((str(s["patch"]), version, str(s["target"]), code) if args.wide
                    else (str(s["patch"]), version, code))
    print(format_table(rows, wide=args.wide))
    return 0


def _run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command  # only the separator goes
    if not command:
        print("gradpatch run: give a command to run, e.g. `gradpatch run -- python train.py`", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.patches:
        env["GRADPATCH"] = ",".join(args.patches)
    elif env.get("GRADPATCH", "").strip().lower() in _OFF:
        env["GRADPATCH"] = "1"
    if args.exclude:
        env["GRADPATCH_EXCLUDE"] = ",".join(args.exclude)
    if args.checkpoint:
        env["GRADPATCH_CHECKPOINT"] = args.checkpoint
    if args.strict:
        env["GRADPATCH_STRICT"] = "1"
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"gradpatch run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


def _policy(text: str) -> str:
    from gradpatch.settings import check_policy

    try:
        return check_policy(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _doctor(args: argparse.Namespace) -> int:
    if args.script is None:
        args.parser.print_help()
        return 2
    from gradpatch.doctor import run_script

    run_script(args.script, args.args)
    return 0


def _tradeoff(args: argparse.Namespace) -> int:
    import importlib

    module, _, name = args.factory.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module), name or "step")
    except (ImportError, AttributeError) as error:
        print(f"gradpatch tradeoff: cannot load {args.factory!r}: {error}; give MODULE:FACTORY, "
              f"FACTORY() returning the step function", file=sys.stderr)
        return 2
    from gradpatch.checkpointing.tradeoff import tradeoff

    result = tradeoff(factory(), fractions=args.fractions, repeats=args.repeats)
    print(result)
    if args.plot:
        result.plot(args.plot, title=args.factory)
        print(f"gradpatch tradeoff: plot written to {args.plot}")
    return 0


def _version_line() -> str:
    import gradpatch

    where = os.path.dirname(gradpatch.__file__)
    return f"gradpatch {gradpatch.__version__} from {where} (Python {sys.version.split()[0]})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradpatch",
                                     description="Make gradients flow through upstream diffusion code.",
                                     epilog="Activate with GRADPATCH=1 (every Python process), `gradpatch run -- CMD`, "
                                            "or gradpatch.apply() in code; the README's Install and Use say more.")
    parser.add_argument("--version", action="store_true", help="print the version and where gradpatch is imported from")
    commands = parser.add_subparsers(dest="command_name", metavar="COMMAND")
    listing = commands.add_parser("list", help="every known patch")
    status = commands.add_parser("status", help="installed targets and whether their code is recognised")
    for sub in (listing, status):
        shape = sub.add_mutually_exclusive_group()
        shape.add_argument("--wide", action="store_true", help="one line per row, however long")
        shape.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--all", action="store_true", help="every patch, one row each")
    listing.add_argument("codebase", nargs="?", metavar="CODEBASE", help="only this codebase's patches (audioldm)")
    listing.add_argument("--all", action="store_true", help="every patch, grouped by codebase")
    listing.set_defaults(handler=print_list)
    status.set_defaults(handler=_print_status)
    run = commands.add_parser("run", help="run a command with gradpatch active in every Python process")
    run.add_argument("--patches", action="append", metavar="NAME", help="patch or upstream name (repeatable; default: all)")
    run.add_argument("--exclude", action="append", metavar="NAME", help="leave this patch or upstream out (repeatable)")
    run.add_argument("--checkpoint", type=_policy, metavar="POLICY",
                     help="checkpoint policy: respect, always, never, budget:<size> (budget:2GiB) or peak:<size> (peak:6GiB)")
    run.add_argument("--strict", action="store_true", help="raise instead of warning")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(handler=_run)
    doctor = commands.add_parser("doctor", help="run a script and explain parameters that get no gradient",
                                 description="Run a training script unchanged and, after each backward, name every "
                                             "parameter that requires grad but got no gradient, with its cause.",
                                 epilog="example: gradpatch doctor train.py --lr 1e-4")
    doctor.add_argument("script", nargs="?", help="the training script")
    doctor.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    doctor.set_defaults(handler=_doctor, parser=doctor)
    trade = commands.add_parser("tradeoff", help="time and memory of a training step under checkpoint policies",
                                description="Call FACTORY() from MODULE once; time the step function it returns "
                                            "under respect, budgets between respect and never, and never; "
                                            "print a table (and a PNG plot with --plot, which needs matplotlib).",
                                epilog="example: gradpatch tradeoff mytrain:make_step --plot curve.png")
    trade.add_argument("factory", metavar="MODULE:FACTORY", help="FACTORY() returns a no-argument training step")
    trade.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                       help="budgets as fractions of the memory gap between respect and never")
    trade.add_argument("--repeats", type=int, default=5, help="timed steps per policy")
    trade.add_argument("--plot", metavar="PNG", help="write the curve to this PNG file")
    trade.set_defaults(handler=_tradeoff)
    args = parser.parse_args(argv)
    if args.version:  # printed as is: argparse's version action wraps it to the terminal's width
        print(_version_line())
        return 0
    if args.command_name is None:
        parser.print_help()
        return 0
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
