"""The ``gradpatch`` command (also ``python -m gradpatch``).

``gradpatch list``                  every known patch, its target and what it fixes
``gradpatch status [--json]``       which targets are installed here, their versions, and whether their
                                    code matches a known fingerprint (read from source: nothing is
                                    imported, so neither torch nor any target is loaded)
``gradpatch run [OPTIONS] -- CMD``  run CMD with gradpatch active in it and every Python process it
                                    starts (sets ``GRADPATCH*`` and execs, like ``ddtrace-run``)
``gradpatch doctor SCRIPT [ARGS]``  run a training script and, after each backward, explain every
                                    parameter that requires grad but got no gradient
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Sequence

from gradpatch.fingerprint import Fingerprints, fingerprint_source
from gradpatch.registry import Patch


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


def _version(patch: Patch) -> str | None:
    if not patch.requires:
        return None
    from importlib.metadata import PackageNotFoundError, version

    from gradpatch.activation import split_requirement

    try:
        return version(split_requirement(patch.requires)[0])
    except PackageNotFoundError:
        return None


def _status(patch: Patch) -> dict[str, object]:
    path = _source_path(patch.module)
    row: dict[str, object] = {"patch": patch.name, "target": patch.target, "installed": path is not None,
                              "version": _version(patch) if path else None, "code": "not installed"}
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


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def _list(_: argparse.Namespace) -> int:
    from gradpatch.activation import known_patches

    rows = [("patch", "upstream", "target", "fixes")]
    rows += [(p.name, p.upstream, p.target, p.summary) for p in known_patches().values()]
    print(_table(rows))
    return 0


def _print_status(args: argparse.Namespace) -> int:
    from gradpatch.activation import known_patches

    statuses = [_status(p) for p in known_patches().values()]
    if args.json:
        print(json.dumps(statuses, indent=2))
        return 0
    rows = [("patch", "version", "target", "code")]
    rows += [(str(s["patch"]), str(s["version"] or "-"), str(s["target"]), str(s["code"])) for s in statuses]
    print(_table(rows))
    return 0


def _run(args: argparse.Namespace) -> int:
    command = [part for part in args.command if part != "--"] if args.command[:1] == ["--"] else args.command
    if not command:
        print("gradpatch run: give a command to run, e.g. `gradpatch run -- python train.py`", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.patches:
        env["GRADPATCH"] = ",".join(args.patches)
    elif env.get("GRADPATCH", "").strip() in ("", "0"):
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
    from gradpatch.budget import check_policy
    from gradpatch.settings import CHECKPOINT_POLICIES

    try:
        return check_policy(text, CHECKPOINT_POLICIES)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _doctor(args: argparse.Namespace) -> int:
    from gradpatch.doctor import run_script

    run_script(args.script, args.args)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradpatch", description="Make gradients flow through upstream diffusion code.")
    commands = parser.add_subparsers(dest="command_name", required=True)
    commands.add_parser("list", help="every known patch").set_defaults(handler=_list)
    status = commands.add_parser("status", help="installed targets and whether their code is recognised")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(handler=_print_status)
    run = commands.add_parser("run", help="run a command with gradpatch active in every Python process")
    run.add_argument("--patches", action="append", metavar="NAME", help="patch or upstream name (repeatable; default: all)")
    run.add_argument("--exclude", action="append", metavar="NAME", help="leave this patch or upstream out (repeatable)")
    run.add_argument("--checkpoint", type=_policy, metavar="POLICY",
                     help="checkpoint policy: respect, always, never or budget:<size> (budget:2GiB)")
    run.add_argument("--strict", action="store_true", help="raise instead of warning")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(handler=_run)
    doctor = commands.add_parser("doctor", help="run a script and explain parameters that get no gradient")
    doctor.add_argument("script", help="the training script")
    doctor.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    doctor.set_defaults(handler=_doctor)
    args = parser.parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
