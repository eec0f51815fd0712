"""What gradpatch costs at start-up and at import time (fresh interpreters, medians of repeated runs).

1. the ``gradpatch.pth`` line with ``GRADPATCH`` unset (target: well under 1 ms);
2. ``import gradpatch`` (and whether torch came with it: it must not);
3. interpreter start with ``GRADPATCH=1`` against unset, no target imported;
4. ``GRADPATCH=1`` with a real target, beyond the target's own import (target: < 30 ms): the
   import time of the modules gradpatch adds to ``import audioldm`` (those the target does not import
   itself) plus the time spent inside gradpatch's import hooks;
5. the scan for family copies (``gradpatch.patching.scan``) on ``import diffusers`` + ``import audioldm``
   (target: under 5% of those imports and under 20 ms), in CPU time: the per-module check times the
   modules checked, the examinations of modules holding a member name, the scan's finder beyond
   PathFinder's own work (measured side by side) times its calls, and the ``sys.modules`` sweep that
   ``apply()`` runs. Comparing whole imports with ``GRADPATCH_SCAN=0`` cannot resolve it: their
   run-to-run scatter is larger than the scan's total.

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
import json, time, gradpatch.patching.activation as a
spent = [0.0]
inner = a._on_import
def timed(module):
    t = time.perf_counter(); inner(module); spent[0] += time.perf_counter() - t
a._on_import = timed
t = time.perf_counter(); import audioldm; total = time.perf_counter() - t
print(json.dumps([spent[0] * 1e3, total * 1e3, [str(r.status) for r in a.report()]]))
"""


# Timers around every call would cost more than the calls they time (a few hundred ns each), so the
# import counts what the scan does, times the rare examinations directly, and the per-call costs of
# the common paths are measured afterwards in the same process. All in this thread's CPU time (best
# of repeats), import included: on a shared machine wall time mostly measures the other processes.
SCAN_PROBE = """
import json, sys, time, timeit
from importlib.machinery import PathFinder
import gradpatch.patching.scan as scan
checked, finds, examined = [0], [0], []
check, examine, find_spec = scan._imported, scan._examine, scan._find_spec
def counted_check(module, late=False):
    checked[0] += 1
    return check(module, late)
def timed_examine(*args):
    t = time.thread_time(); found = examine(*args); examined.append(time.thread_time() - t)
    return found
def counted_find(*args):
    finds[0] += 1
    return find_spec(*args)
scan._imported, scan._examine, scan._find_spec = counted_check, timed_examine, counted_find
t = time.thread_time(); import diffusers, audioldm; total = time.thread_time() - t
scan._imported, scan._examine, scan._find_spec = check, examine, find_spec
def best(function, number):
    return min(timeit.repeat(function, number=number, repeat=9, timer=time.thread_time)) / number
plain = [m for m in list(sys.modules.values())
         if isinstance(getattr(m, "__dict__", None), dict) and m.__dict__.keys().isdisjoint(scan._names)]
per_check = best(lambda: [check(m) for m in plain], 10) / len(plain)
lookups = [(m.__name__, sys.modules[m.__spec__.parent].__path__) for m in plain
           if getattr(m, "__spec__", None) is not None and m.__spec__.parent in sys.modules
           and m.__spec__.origin and m.__spec__.origin.endswith(".py")][:300]
scan_find = best(lambda: [scan._ScanPathFinder.find_spec(n, p) for n, p in lookups], 3) / len(lookups)
path_find = best(lambda: [PathFinder.find_spec(n, p) for n, p in lookups], 3) / len(lookups)
sweep = best(scan.sweep, 10)
found = [r.patch for r in scan.sweep()]
print(json.dumps([total * 1e3, checked[0], per_check * 1e6, len(examined), sum(examined) * 1e3, finds[0],
                  (scan_find - path_find) * 1e6, sweep * 1e3, len(sys.modules), found]))
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
    import gradpatch.patching.catalogue

    roots = {Path(gradpatch.__file__).parent, Path(gradpatch.patching.catalogue._builtin_package().__file__).parent}
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

    runs = [json.loads(run(SCAN_PROBE, GRADPATCH="1").splitlines()[-1]) for _ in range(max(3, repeats // 3))]
    total, checked, per_check, n_examined, examined, finds, per_find, sweep, modules, found = [
        statistics.median(r[i] for r in runs) if isinstance(runs[0][i], float) else runs[0][i] for i in range(10)]
    cost = checked * per_check / 1e3 + examined + finds * max(per_find, 0.0) / 1e3
    print(f"scan, GRADPATCH=1, import diffusers + audioldm ({total:.0f} ms CPU, {checked} modules): {cost:.2f} ms "
          f"({cost / total:.3%}) = {checked} checks x {per_check:.2f} us + {n_examined} examined "
          f"({examined:.2f} ms) + {finds} finder calls x {per_find:+.2f} us beyond PathFinder; "
          f"copies found: {found or 'none'}")
    print(f"  + sys.modules sweep at apply(), after both imports: {sweep:.2f} ms over {modules} modules")


if __name__ == "__main__":
    main()
