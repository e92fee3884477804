"""The manual (docs/, mkdocs.yml) builds with ``mkdocs build --strict``: a
broken link, a missing anchor, a snippet whose file is gone or an API name that
no longer resolves fails the suite. The README stays a front door, the API
reference covers everything ``remote_tpu`` exports, and the architecture page
names every module as it is in the tree."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 220
# The tools the build needs (the `docs` extra, which the `test` extra includes).
DOCS_MODULES = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material",
                "pymdownx")


def _require_docs_tools() -> None:
    """Fail, never skip: the suite installs the docs tools (pyproject's `test`
    extra includes `docs`), so their absence is a broken environment."""
    missing = [m for m in DOCS_MODULES if importlib.util.find_spec(m.split(".")[0]) is None
               or importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"the docs tools are not installed (missing: {', '.join(missing)}): "
                    f"run the suite with `bash scripts/test.sh`, or "
                    f"`{sys.executable} -m pip install -e '.[docs]'`", pytrace=False)


def _build(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    # NO_MKDOCS_2_WARNING: the theme's banner about MkDocs' future, not ours to fix.
    # Never --quiet: it hides warnings from the count that --strict fails on, and a
    # broken link then builds.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(config), "-d", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_the_manual_builds_strictly(tmp_path):
    _require_docs_tools()
    proc = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert 'id="remote_tpu.run"' in reference and 'id="remote_tpu.JobHandle"' in reference
    performance = (tmp_path / "site" / "performance" / "index.html").read_text()
    assert "cold_call.py" in performance              # benchmarks/README.md, included


def _broken_config(tmp_path: pathlib.Path, page: str) -> pathlib.Path:
    """Our mkdocs.yml, on a docs dir of one page."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(page)
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}])
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page, said", [
    ("# Home\n\nSee [the guide](no-such-page.md).\n", "no-such-page.md"),
    ("# Home\n\nSee [options](#no-such-anchor).\n", "no-such-anchor"),
    ("# Home\n\n::: remote_tpu.no_such_name\n", "remote_tpu.no_such_name"),
], ids=["page", "anchor", "api-name"])
def test_the_strict_build_fails_on_a_broken_link_or_reference(tmp_path, page, said):
    _require_docs_tools()
    proc = _build(_broken_config(tmp_path, page), tmp_path / "site")
    assert proc.returncode != 0, f"a page with {said!r} built:\n{proc.stdout}{proc.stderr}"
    assert said in proc.stdout + proc.stderr


@pytest.mark.timeout(30)
def test_the_readme_stays_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move the detail into "
        f"docs/ (guide.md, options.md, ...) and link to it")
    text = "\n".join(lines)
    for command in ("bash scripts/quickstart.sh", "bash scripts/test.sh"):
        assert command in text, f"the README lost its set-up command {command!r}"
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", text):
        assert (ROOT / link).is_file(), f"README.md links to {link}, which is not there"


@pytest.mark.timeout(30)
def test_the_api_reference_documents_everything_exported():
    import remote_tpu

    reference = (DOCS / "reference.md").read_text()
    documented = set(re.findall(r"^::: remote_tpu\.(\w+)\s*$", reference, re.M))
    missing = sorted(set(remote_tpu.__all__) - documented)
    assert not missing, f"add to docs/reference.md: {', '.join(f'::: remote_tpu.{m}' for m in missing)}"
    extra = sorted(documented - set(remote_tpu.__all__))
    assert not extra, f"docs/reference.md documents names not in remote_tpu.__all__: {extra}"


def _agent_table() -> dict[str, set[str]]:
    """The architecture page's agent table: each wing's modules, as listed."""
    text = (DOCS / "architecture.md").read_text().split("### The agent", 1)[1]
    text = text.split("\n### ", 1)[0]
    wings: dict[str, set[str]] = {}
    wing = None
    for line in text.splitlines():
        if m := re.match(r"^\| `(\w+)/` \|", line):
            wing = m.group(1)
            wings[wing] = set()
        elif wing and (m := re.match(r"^\| \| ([^|]+) \|", line)):
            wings[wing] |= set(re.findall(r"`(\w+)\.py`", m.group(1)))
        elif not line.startswith("|"):
            wing = None
    return wings


@pytest.mark.timeout(30)
def test_the_architecture_page_names_every_module_where_it_is():
    listed = _agent_table()
    tree = {d.name: {p.stem for p in d.glob("*.py") if p.stem != "__init__"}
            for d in sorted((ROOT / "agent").iterdir()) if (d / "__init__.py").is_file()}
    assert listed == tree, (
        "docs/architecture.md's agent table differs from agent/: "
        f"wings {sorted(set(tree) ^ set(listed))}; modules missing "
        f"{sorted(f'{w}/{m}.py' for w in tree for m in tree[w] - listed.get(w, set()))}, "
        f"gone {sorted(f'{w}/{m}.py' for w in listed for m in listed[w] - tree.get(w, set()))}")
    text = (DOCS / "architecture.md").read_text()
    client = [*(ROOT / "remote_tpu").glob("*.py"), *(ROOT / "remote_tpu" / "_core").glob("*.py")]
    unnamed = sorted(str(p.relative_to(ROOT)) for p in client
                     if p.stem != "__main__" and not (p.stem == "__init__" and p.parent.name == "_core")
                     and f"`{p.name}`" not in text)
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"
