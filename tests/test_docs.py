"""The front page and the docs: README's quick start runs as written (on the CPU), every relative link in the
Markdown files points at a file that exists, and project files describe the project, not the history of its
making (no work-log words; git keeps the history)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_quick_start_runs_as_written(tmp_path):
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) >= 2, "README lost its quick start"
    pytest.importorskip("transformers")
    # one fresh interpreter runs the blocks in order, as a reader pasting them would (the second uses the first's
    # imports); it must leave `y`, `out` and `tokens` with the shapes the comments promise
    check = (
        "\nassert y.shape == out.shape == x.shape, (y.shape, out.shape)\nassert tokens.shape == (1, 7), tokens.shape\n"
    )
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks) + check)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            missing.append(target)
    assert not missing, f"{path.name} links to files that do not exist: {missing}"


#: Work-log wording: sessions, device time, tracker numbers. pytest's scope="session" is the one legitimate use.
DIARY = re.compile(r"session|device time|#1[0-9]\b", re.I)


def test_project_files_carry_no_work_log():
    files = [*MARKDOWN]
    for folder in ("src", "scripts", "tests"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".json", ""}]
    hits = []
    for path in files:
        if path == Path(__file__) or "__pycache__" in path.parts:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if DIARY.search(line.replace('scope="session"', "")):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, "history belongs in git, not in project files:\n" + "\n".join(hits)
