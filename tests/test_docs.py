"""The documentation site builds with MkDocs in strict mode: a broken link, a missing anchor, a
page left out of the navigation or an API reference that no longer resolves fails the suite."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_docs_site_builds_without_warnings(tmp_path):
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as e:
        pytest.fail(f"{e}: the test extra installs MkDocs (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    api = (tmp_path / "site" / "reference" / "numpy" / "index.html").read_text(encoding="utf-8")
    # the reference is generated from the docstrings, not written by hand
    assert "allreduce_async" in api and "ProcessSet" in api


def test_the_readme_links_to_pages_that_exist():
    import re
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    links = re.findall(r"\]\((docs/[^)#]*)", readme)
    assert links
    missing = [link for link in links if not os.path.exists(os.path.join(ROOT, link))]
    assert missing == []


def test_the_testing_page_names_every_package_a_test_needs():
    import needed_tools
    page = open(os.path.join(ROOT, "docs", "testing.md"), encoding="utf-8").read()
    unnamed = sorted({p for p in needed_tools.PACKAGES.values() if f"`{p}`" not in page})
    assert unnamed == []
