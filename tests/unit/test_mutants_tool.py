"""tools/mutants_multirank.py stays applicable: each mutant's text is in its file once
(the tool refuses a mutant otherwise), and each test it runs exists under that name."""
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    "mutants_multirank", os.path.join(ROOT, "tools", "mutants_multirank.py"))
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.mark.parametrize("mutant", tool.MUTANTS, ids=[m[0] for m in tool.MUTANTS])
def test_each_mutant_applies_once_and_names_tests_that_exist(mutant):
    name, rel, old, new, tests = mutant
    text = open(os.path.join(ROOT, rel)).read()
    assert text.count(old) == 1 and old != new
    if name in tool.EXTRA:
        assert text.count(tool.EXTRA[name][0]) == 1
    for path, np_, expr, env in tests:
        source = open(os.path.join(ROOT, path)).read()
        names = re.findall(r"^def (test_\w+)", source, re.M)
        # each word of the -k expression (case ids such as 130x130 aside) is in a test's name
        words = [w for w in re.findall(r"[a-z_]+(?![\w-])", expr) if w not in ("and", "or", "not")]
        assert words and all(any(w in n for n in names) for w in words), (expr, names)
