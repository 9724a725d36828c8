"""Every code block of README.md, docs/*.md and examples/*/README.md: each ```python block runs as written, in a
fresh namespace from the repository root, so every name it uses is defined in the block itself. A block preceded by
`<!-- gpu -->` needs an sm_90 GPU with the kernels (skipped elsewhere); a CPU block must also run without the
extension. Blocks in other languages (shell, C++) are not run and must say so with `<!-- no-run -->`."""
import re
import sys
import types
from pathlib import Path

import pytest

from conftest import HAVE_SM90, WHY_NOT

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
# an optional marker comment on the line before the fence, the language, the code
BLOCK = re.compile(r"(?:^<!--\s*([\w-]+)\s*-->\n)?^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks():
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start(2 if m[1] is None else 1)) + 1
            yield pytest.param(m[1], m[2], m[3], id=f"{path.relative_to(ROOT)}:{line}")


@pytest.mark.parametrize("marker, lang, code", list(blocks()))
def test_every_block_runs_or_is_marked(marker, lang, code, monkeypatch, request):
    if lang != "python":
        assert marker == "no-run", f"a ```{lang} block is not run: say so with <!-- no-run -->"
        return
    assert marker in (None, "gpu"), "python blocks all run: mark one that needs the GPU <!-- gpu -->"
    if marker == "gpu" and not HAVE_SM90:
        pytest.skip(WHY_NOT)
    monkeypatch.chdir(ROOT)
    # a real module, as a script's __main__ is: torch.compile looks the block's globals up in sys.modules
    module = types.ModuleType("__doc_block__")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, request.node.callspec.id, "exec"), module.__dict__)  # conftest restores torch's determinism


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_and_no_history(path):
    text = path.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)", text):  # relative links: files of this repository
        assert target.startswith("http") or (path.parent / target).exists(), f"{path.name}: no such file {target}"
    # the docs state rules and reasons: no commit ids, decision numbers or issue numbers
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b|\bD\d{1,2}\b|[Ii]ssue \d", text)
