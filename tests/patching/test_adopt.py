"""``gradpatch.adopt`` and ``GRADPATCH_ADOPT``: a user's copy that differs from every known version by
one line, patched on the user's word with a catalogued fix (fresh interpreters).

``vendored/util.py`` is AudioLDM's ``checkpoint`` and ``CheckpointFunction`` (PyPI audioldm 0.1.1,
``audioldm/latent_diffusion/util.py``, read from the installed package) with one line of
``CheckpointFunction.forward`` rewritten: unknown to gradpatch, and as broken as the original (a frozen
parameter makes ``backward()`` raise). Gradients are compared with the same block run without any
checkpoint in float64, for every trainable parameter and the input.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from support import last_json, run_python

ONE_LINE = ("ctx.input_params = list(args[length:])", "ctx.input_params = [p for p in args[length:]]")

BLOCK = '''

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.outer = torch.nn.Linear(4, 3)

    def forward(self, x):
        return checkpoint(self._forward, (x,), self.parameters(), True)

    def _forward(self, x):
        return self.outer(torch.tanh(self.frozen(torch.tanh(self.inner(x)))))
'''

HELPERS = '''
import json, sys, warnings, torch
torch.manual_seed(0)
import gradpatch

def grads(use_checkpoint):
    """Gradients of every trainable parameter and the input, float64; the error message if backward raises."""
    from vendored import util
    torch.manual_seed(1)
    block = util.Block().double()
    x = torch.randn(2, 4, dtype=torch.double, requires_grad=True)
    out = block(x) if use_checkpoint else block._forward(x)
    tensors = [p for p in block.parameters() if p.requires_grad] + [x]
    try:
        return [g.tolist() for g in torch.autograd.grad((out * out).sum(), tensors)]
    except RuntimeError as error:
        return str(error).splitlines()[0]

def warned(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = run()
    return value, [f"{type(w.message).__name__}: {w.message}" for w in caught if "gradpatch" in str(w.message)]

def records(prefix="vendored"):
    return {r.patch: [r.status.value, r.upstream, r.reason, r.variant] for r in gradpatch.report()
            if r.target.startswith(prefix)}
'''


@pytest.fixture(scope="module")
def vendored(tmp_path_factory) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("audioldm")
    assert spec is not None and spec.origin, "audioldm (requirements/upstream.txt) is not installed"
    source = (Path(spec.origin).parent / "latent_diffusion" / "util.py").read_text()
    tree = ast.parse(source)
    pieces = [ast.get_source_segment(source, node) for node in tree.body
              if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in ("checkpoint", "CheckpointFunction")]
    copy = "import torch\n\n\n" + "\n\n\n".join(pieces)  # type: ignore[arg-type]
    assert copy.count(ONE_LINE[0]) == 1
    root = tmp_path_factory.mktemp("adopt")
    (root / "vendored").mkdir()
    (root / "vendored" / "__init__.py").write_text("")
    (root / "vendored" / "util.py").write_text(copy.replace(*ONE_LINE) + BLOCK)
    (root / "vendored" / "original.py").write_text(copy + BLOCK)  # the same code, unchanged: known
    return root


def test_apply_leaves_the_copy_alone_and_says_how_to_adopt_it_then_adopt_gives_the_reference_gradients(vendored):
    result = last_json(run_python(HELPERS + '''
gradpatch.apply("audioldm")
_, warnings_seen = warned(lambda: __import__("vendored.util"))
before = grads(True)
reference = grads(False)
from vendored import util
originals = (util.checkpoint, util.CheckpointFunction)
first = gradpatch.adopt("vendored.util:CheckpointFunction", like="audioldm.CheckpointFunction")
again = gradpatch.adopt("vendored.util:CheckpointFunction", like="audioldm.CheckpointFunction")
gradpatch.adopt("vendored.util:checkpoint", like="audioldm.checkpoint")
after = grads(True)
adopted = records()
text = str(gradpatch.report()) + gradpatch.report().table("adopted")
gradpatch.revert()
restored = (util.checkpoint, util.CheckpointFunction) == originals and all(
    a is b for a, b in zip((util.checkpoint, util.CheckpointFunction), originals))
print(json.dumps([warnings_seen, before, reference, [first.status.value, first == again], after, adopted,
                  "adopted: 2 applied" in text and "adopted like audioldm.checkpoint" in text, restored, grads(True), records()]))
''', pythonpath=[vendored]))
    warnings_seen, before, reference, (status, same), after, adopted, shown, restored, reverted, final = result
    (warning,) = warnings_seen
    assert warning.startswith("UnknownCodeWarning: gradpatch: vendored.util does not match any known version")
    assert ('gradpatch.adopt("vendored.util:checkpoint", like="audioldm.checkpoint"); '
            'gradpatch.adopt("vendored.util:CheckpointFunction", like="audioldm.CheckpointFunction")') in warning
    assert ("GRADPATCH_ADOPT=vendored.util:checkpoint=audioldm.checkpoint,"
            "vendored.util:CheckpointFunction=audioldm.CheckpointFunction") in warning
    assert "add this fingerprint" not in warning
    # apply() alone: the copy is unknown code, left alone, and as broken as upstream.
    assert before == "One of the differentiated Tensors does not require grad", before
    assert status == "applied" and same
    _assert_close(after, reference)
    assert adopted["vendored.util:CheckpointFunction"][:2] == ["applied", "adopted"]
    assert adopted["vendored.util:CheckpointFunction"][2].startswith(
        "adopted like audioldm.CheckpointFunction: fixed checkpoint")
    assert adopted["vendored.util:checkpoint"][3].startswith("adopted like audioldm.checkpoint (fingerprint ")
    # The scan's records of the same targets say that they were adopted instead.
    assert adopted["vendored.util.CheckpointFunction"][0] == "skipped"
    assert adopted["vendored.util.CheckpointFunction"][2].startswith(
        "adopted instead (vendored.util:CheckpointFunction); was: unknown code")
    assert shown and restored
    assert reverted == before  # the original objects back: broken again
    assert final["vendored.util:CheckpointFunction"][0] == "reverted"


def _assert_close(got, want):
    import torch

    from support import assert_grads_close

    assert isinstance(got, list), got
    assert len(got) == len(want) == 5  # inner.weight, inner.bias, outer.weight, outer.bias, x
    assert_grads_close([torch.tensor(g, dtype=torch.double) for g in got],
                       [torch.tensor(w, dtype=torch.double) for w in want], rtol=1e-10)


def test_the_variable_adopts_at_start_up_a_module_imported_later(vendored):
    result = last_json(run_python(HELPERS + '''
import vendored.util
print(json.dumps([records(), grads(True), grads(False)]))
''', pythonpath=[vendored], env={"GRADPATCH": "1", "GRADPATCH_ADOPT": "vendored.util:checkpoint=audioldm.checkpoint, "
                                 "vendored.util:CheckpointFunction=audioldm.CheckpointFunction"}))
    found, after, reference = result
    assert {name: row[:2] for name, row in found.items()} == {
        "vendored.util:checkpoint": ["applied", "adopted"], "vendored.util:CheckpointFunction": ["applied", "adopted"]}
    _assert_close(after, reference)


def test_a_bad_variable_entry_is_one_config_warning_and_the_rest_is_adopted(vendored):
    done = run_python(HELPERS + '''
import vendored.util
print(json.dumps(records()))
''', pythonpath=[vendored], env={"GRADPATCH": "audioldm", "GRADPATCH_ADOPT":
                                 "vendored.util, vendored.util:CheckpointFunction=audioldm.CheckpointFunctoin,"
                                 "vendored.util:checkpoint=audioldm.checkpoint"})
    found = last_json(done)
    assert {name: row[0] for name, row in found.items()} == {"vendored.util:checkpoint": "applied"}
    config = [line for line in done.stderr.splitlines() if "ConfigWarning" in line]
    assert len(config) == 2, done.stderr
    assert "entry 'vendored.util' is ignored: 'vendored.util' has no '=PATCH'" in config[0]
    assert "did you mean 'audioldm.CheckpointFunction'?" in config[1]


def test_bad_input_is_refused_with_one_message_saying_what_to_do(vendored):
    messages = last_json(run_python(HELPERS + '''
import vendored.util
def refused(*args, **kwargs):
    try:
        gradpatch.adopt(*args, **kwargs)
    except ValueError as error:
        return str(error)
    return "accepted"
print(json.dumps([
    refused("vendored.util:checkpoint", like="audioldm.chekpoint"),
    refused("vendored.util.checkpoint", like="audioldm.checkpoint"),
    refused("vendored.util:nothing_here", like="audioldm.checkpoint"),
    refused("vendored.util:checkpoint", like="audioldm.CheckpointFunction"),
    refused("vendored.util:CheckpointFunction", like="audioldm.checkpoint"),
    refused("vendored.util:Block.forward", like="audioldm.checkpoint"),
    len(gradpatch.report()),
]))
''', pythonpath=[vendored]))
    unknown, malformed, missing, function_as_class, class_as_function, signature, recorded = messages
    assert unknown.startswith("gradpatch.adopt: like='audioldm.chekpoint' is not a patch of the catalogue; "
                              "did you mean 'audioldm.checkpoint'?")
    assert "'vendored.util.checkpoint' is not a target: give \"module:Qual.name\"" in malformed
    assert missing.startswith("gradpatch.adopt: vendored.util has no attribute 'nothing_here'")
    assert "is a function, but audioldm.CheckpointFunction replaces a class" in function_as_class
    assert "is a class, but audioldm.checkpoint replaces a function" in class_as_function
    assert "does not take the parameters audioldm.checkpoint's fix expects (func, inputs, params, flag" in signature
    assert recorded == 0  # nothing was adopted


def test_a_lazy_module_stays_lazy_until_first_use_then_is_adopted(vendored):
    found = last_json(run_python(HELPERS + '''
import importlib.util
spec = importlib.util.find_spec("vendored.util")
spec.loader = importlib.util.LazyLoader(spec.loader)
module = importlib.util.module_from_spec(spec)
sys.modules["vendored.util"] = module
spec.loader.exec_module(module)
record = gradpatch.adopt("vendored.util:CheckpointFunction", like="audioldm.CheckpointFunction")
lazy = type(module).__name__
status = record.status.value
module.Block  # first use: the body runs
print(json.dumps([lazy, status, records()["vendored.util:CheckpointFunction"][0],
                  module.CheckpointFunction.__module__.startswith("gradpatch")]))
''', pythonpath=[vendored]))
    assert found == ["_LazyModule", "deferred", "applied", True]


def test_an_unchanged_copy_needs_no_adoption(vendored):
    result = last_json(run_python(HELPERS + '''
gradpatch.apply("audioldm")
_, seen = warned(lambda: __import__("vendored.original"))
known = records("vendored.original")
print(json.dumps([seen, known]))
''', pythonpath=[vendored]))
    seen, known = result
    assert seen == [] and known["vendored.original.CheckpointFunction"][0] == "applied"
