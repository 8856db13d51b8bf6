"""The manual stays true: docs/cli.md is the parser's, every relative link and anchor in
README.md and docs/ resolves, and every example marked runnable runs (small jobs, seconds)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CHILD_ENV

from wavelet.scripts.cli_reference import reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RUNNABLE = re.compile(r"<!-- runnable(?:: ([\w./-]+))? -->\n```(\w+)\n(.*?)```", re.S)


def test_cli_md_is_the_parsers():
    assert (ROOT / "docs" / "cli.md").read_text() == reference(), (
        "docs/cli.md is out of date: python -m wavelet.scripts.cli_reference > docs/cli.md"
    )


def _slug(heading: str) -> str:
    """A heading's anchor as code hosts make it: lower case, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, broken


RUNNABLE_PAGES = [p for p in PAGES if "<!-- runnable" in p.read_text()]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_runnable_example_runs(page, tmp_path):
    """Blocks marked ``<!-- runnable: NAME -->`` are written to NAME; blocks marked
    ``<!-- runnable -->`` run (python or bash), in the order of the page, in one folder."""
    for name, language, code in RUNNABLE.findall(page.read_text()):
        if name:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(code)
            continue
        command = [sys.executable, "-c", code] if language == "python" else ["bash", "-c", code]
        env = {**CHILD_ENV, "PATH": f"{Path(sys.executable).parent}:{CHILD_ENV['PATH']}"}
        done = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
        )
        assert done.returncode == 0, (
            f"{page.name}:\n{code}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
