"""The engine's version check agrees with packaging's PEP 440 SpecifierSet (prereleases included)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet

from gradpatch.patching.versions import contains, split_requirement

versions = st.builds(lambda a, b, c, tail: f"{a}.{b}.{c}{tail}", st.integers(0, 3), st.integers(0, 3),
                     st.integers(0, 2), st.sampled_from(["", "rc1", "a2", ".post1", ".dev0", "b1"]))
bounds = st.builds(lambda a, b, tail: f"{a}.{b}{tail}", st.integers(0, 3), st.integers(0, 3),
                   st.sampled_from(["", "", "rc1", ".post1"]))
clauses = st.builds(lambda op, bound: op + bound, st.sampled_from([">=", "<=", "<", ">", "==", "!=", "~="]), bounds)


@settings(max_examples=400, deadline=None)
@given(st.lists(clauses, min_size=1, max_size=3), versions)
def test_matches_packaging(specifier_clauses, version):
    specifier = ",".join(specifier_clauses)
    assert contains(specifier, version) == SpecifierSet(specifier).contains(version, prereleases=True)


def test_split_requirement():
    assert split_requirement("diffusers>=0.25,<0.43") == ("diffusers", ">=0.25,<0.43")
    assert split_requirement("f5-tts") == ("f5-tts", "")
    assert split_requirement("e2-tts-pytorch ==2.2.2") == ("e2-tts-pytorch", "==2.2.2")
