"""What gradpatch costs at start-up and at import time (fresh interpreters, medians of repeated runs).

1. the ``gradpatch.pth`` line with ``GRADPATCH`` unset (target: well under 1 ms);
2. ``import gradpatch`` (and whether torch came with it: it must not);
3. interpreter start with ``GRADPATCH=1`` against unset, no target imported;
4. ``GRADPATCH=1`` with a real target, beyond the target's own import (target: < 30 ms): the
   import time of the modules gradpatch adds to ``import audioldm`` (those the target does not import
   itself) plus the time spent inside gradpatch's import hooks;
5. watching every module body and scanning it for family copies (``gradpatch.patching.watcher``,
   ``gradpatch.patching.scan``) on ``import diffusers`` + ``import audioldm`` (target: under 5% of those
   imports and under 20 ms), in CPU time: the module bodies the watcher saw times the cost of one
   (the watcher's own work per import, measured side by side with the same work unwatched, plus the
   listener's common path), the patching and examinations of modules holding a target or a member
   name, and the ``sys.modules`` sweep that ``apply()`` runs; also what the watch adds to an
   ``import x`` of a module already imported. Comparing whole imports with ``GRADPATCH_SCAN=0``
   cannot resolve it: their run-to-run scatter is larger than the total.

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
import json, time, gradpatch.patching.activation as a, gradpatch.patching.import_time as i
spent = [0.0]
inner = i.on_import
def timed(module, **kw):
    t = time.perf_counter(); found = inner(module, **kw); spent[0] += time.perf_counter() - t
    return found
i.on_import = timed
t = time.perf_counter(); import audioldm; total = time.perf_counter() - t
print(json.dumps([spent[0] * 1e3, total * 1e3, [str(r.status) for r in a.report()]]))
"""


# Timers around every call would cost more than the calls they time (a few hundred ns each), so the
# import counts the bodies the watcher saw, times the rare patchings and examinations directly, and
# the per-call costs of the common paths are measured afterwards in the same process. All in this
# thread's CPU time (best of repeats), import included: on a shared machine wall time mostly measures
# the other processes.
SCAN_PROBE = """
import json, sys, time, timeit, types
import _frozen_importlib
from gradpatch.patching import import_time as i, ledger, scan, watcher
seen, examined, patched = [0], [], []
listener, on_import = watcher._listener, i.on_import
def counted(module, late):
    seen[0] += 1
    listener(module, late)
def timed_on_import(module, **kw):
    target = module.__name__ in ledger.LEDGER.targets()
    t = time.thread_time(); found = on_import(module, **kw)
    (patched if target else examined).append(time.thread_time() - t)
    return found
watcher._listener, i.on_import = counted, timed_on_import
t = time.thread_time(); import diffusers, audioldm; total = time.thread_time() - t
watcher._listener, i.on_import = listener, on_import
def best(function, number):
    return min(timeit.repeat(function, number=number, repeat=9, timer=time.thread_time)) / number
index = ledger.LEDGER.targets()
plain = [m for m in list(sys.modules.values()) if type(m) is types.ModuleType
         and m.__name__ not in index and not scan.candidate(m.__dict__)]
per_listen = best(lambda: [listener(m, False) for m in plain], 10) / len(plain)
# The watcher's own work per import: the spec's flag set and cleared through the property (the
# listener told of a module that is not in sys.modules: nothing to deliver) and the exec_module
# wrapper around a loader that does nothing, each against the same work unwatched.
spec = _frozen_importlib.ModuleSpec("gradpatch_benchmark_absent", None)
module = types.ModuleType("gradpatch_benchmark_absent")
def flag():
    spec._initializing = True
    spec._initializing = False
noop = lambda loader, module: None
wrapped = watcher._wrap(noop)
def calls(function):
    return lambda: [function(None, module) for _ in range(100)]
watched = best(lambda: [flag() for _ in range(100)], 100) / 100 + best(calls(wrapped), 100) / 100
watcher.stop()
bare = best(lambda: [flag() for _ in range(100)], 100) / 100 + best(calls(noop), 100) / 100
again_bare = best(lambda: [__import__("json") for _ in range(100)], 100) / 100
watcher.start(listener)
again_watched = best(lambda: [__import__("json") for _ in range(100)], 100) / 100
with ledger.LEDGER.locked():
    sweep = best(i.sweep, 10)
print(json.dumps([total * 1e3, seen[0], per_listen * 1e6, (watched - bare) * 1e6, len(examined), sum(examined) * 1e3,
                  (again_watched - again_bare) * 1e9, sweep * 1e3, len(sys.modules), len(patched), sum(patched) * 1e3]))
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

    roots = {Path(gradpatch.__file__).parent, Path(gradpatch.patching.catalogue.builtin_package().__file__).parent}
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
    total, seen, per_listen, per_watch, n_examined, examined, per_again, sweep, modules, n_patched, patched = [
        statistics.median(r[i] for r in runs) if isinstance(runs[0][i], float) else runs[0][i] for i in range(11)]
    cost = seen * (per_listen + max(per_watch, 0.0)) / 1e3 + examined
    print(f"watch + scan, GRADPATCH=1, import diffusers + audioldm ({total:.0f} ms CPU, {seen} module bodies): "
          f"{cost:.2f} ms ({cost / total:.3%}) = {seen} x ({per_watch:.2f} us watching + {per_listen:.2f} us "
          f"listener) + {n_examined} examined by the scan ({examined:.2f} ms); patching the {n_patched} "
          f"targets among them: {patched:.1f} ms")
    print(f"  + sys.modules sweep at apply(), after both imports: {sweep:.2f} ms over {modules} modules; "
          f"`import x` of a module already imported: {per_again:+.0f} ns while watching")

if __name__ == "__main__":
    main()
