"""What gradpatch costs at start-up and at import time (fresh interpreters, medians of repeated runs).

1. the ``gradpatch.pth`` line with ``GRADPATCH`` unset (target: well under 1 ms);
2. ``import gradpatch`` (and whether torch came with it: it must not);
3. interpreter start with ``GRADPATCH=1`` against unset, no target imported;
4. ``GRADPATCH=1`` with a real target, beyond the target's own import (target: < 30 ms): the
   import time of the modules gradpatch adds to ``import audioldm`` (those the target does not import
   itself) plus the time spent inside gradpatch's import hooks.

Usage: python benchmarks/startup.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import timeit
from pathlib import Path


def run(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    full.update(env, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True).stdout


def median_ms(code: str, repeats: int, **env: str) -> float:
    probe = f"import time; t = time.perf_counter(); {code}; print((time.perf_counter() - t) * 1e3)"
    return statistics.median(float(run(probe, **env).split()[-1]) for _ in range(repeats))


def startup_ms(repeats: int, **env: str) -> float:
    times = []
    for _ in range(repeats):
        full = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
        full.update(env)
        start = timeit.default_timer()
        subprocess.run([sys.executable, "-c", "pass"], env=full, check=True)
        times.append((timeit.default_timer() - start) * 1e3)
    return statistics.median(times)


HOOK_TIMER = """
import json, time, gradpatch.activation as a
spent = [0.0]
inner = a._on_import
def timed(module):
    t = time.perf_counter(); inner(module); spent[0] += time.perf_counter() - t
a._on_import = timed
t = time.perf_counter(); import audioldm; total = time.perf_counter() - t
print(json.dumps([spent[0] * 1e3, total * 1e3, [str(r.status) for r in a.report()]]))
"""


def self_times(**env: str) -> dict[str, int]:
    """Self import time (us) of every module ``import audioldm`` loads, from ``-X importtime``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    full.update(env, HF_HUB_OFFLINE="1")
    lines = subprocess.run([sys.executable, "-X", "importtime", "-c", "import audioldm"], env=full,
                           capture_output=True, text=True, check=True).stderr.splitlines()
    rows = [l[len("import time:"):].split("|") for l in lines if l.startswith("import time:") and "[us]" not in l]
    return {row[2].strip(): int(row[0]) for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    repeats = 5 if parser.parse_args().quick else 15
    # Installed packages have bytecode (pip compiles it); a source checkout may not (e.g. with
    # PYTHONDONTWRITEBYTECODE set), which would add compile time that no user pays.
    import gradpatch
    import gradpatch.catalogue

    roots = {Path(gradpatch.__file__).parent, Path(gradpatch.catalogue._builtin_package().__file__).parent}
    subprocess.run([sys.executable, "-m", "compileall", "-q", *map(str, roots)], check=True,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})

    line = (Path(sysconfig.get_paths()["purelib"]) / "gradpatch.pth").read_text().strip()
    os.environ.pop("GRADPATCH", None)
    per_call = min(timeit.repeat(line, number=10000, repeat=5)) / 10000 * 1e6
    print(f"gradpatch.pth line, GRADPATCH unset:          {per_call:8.2f} us per interpreter start")

    importtime = subprocess.run([sys.executable, "-X", "importtime", "-c", "import gradpatch"],
                                capture_output=True, text=True).stderr.splitlines()
    own = next(int(l.split("|")[1]) for l in importtime if l.rstrip().endswith("| gradpatch"))
    torch_loaded = any(l.rstrip().endswith("| torch") for l in importtime)
    print(f"import gradpatch (cumulative, -X importtime):  {own / 1e3:8.2f} ms   torch imported: {torch_loaded}")

    unset, enabled = startup_ms(repeats), startup_ms(repeats, GRADPATCH="1")
    print(f"interpreter start, GRADPATCH unset / =1:      {unset:8.1f} ms / {enabled:.1f} ms "
          f"(+{enabled - unset:.1f} ms, no target imported)")

    hooks, total, statuses = json.loads(run(HOOK_TIMER, GRADPATCH="1").splitlines()[-1])
    samples = [json.loads(run(HOOK_TIMER, GRADPATCH="1").splitlines()[-1])[0] for _ in range(repeats // 3)]
    hooks = statistics.median([hooks] + samples)
    plain, patched = self_times(), self_times(GRADPATCH="1")
    added = sum(us for name, us in patched.items() if name not in plain) / 1e3
    print(f"GRADPATCH=1, import audioldm:                 {hooks:8.1f} ms in gradpatch hooks of "
          f"{total:.0f} ms total ({statuses.count('applied')} patches applied)")
    print(f"  + modules the target does not import itself: {added:6.1f} ms "
          f"(extra beyond the target's own import: {hooks + added:.1f} ms)")


if __name__ == "__main__":
    main()
