"""House limits on the sources, so that each file and function stays readable in one sitting: every file
under tide/ below 400 lines and under csrc/ below 450, every function (Python or C++) below 80 lines, every line
within the line length pyproject.toml sets, every csrc/ include pointing down.
This test reads the sources; it imports nothing of TIDE."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILE_LIMITS = {"tide": 400, "csrc": 450}
FUNCTION_LIMIT = 80
CONTROL = {"if", "for", "while", "switch", "do", "else", "namespace", "struct", "class", "enum", "union", "try",
           "catch", "extern", "return"}


def _sources(top: str) -> list[Path]:
    patterns = ("*.py",) if top == "tide" else ("*.cpp", "*.cu", "*.h", "*.cuh")
    return sorted(p for pattern in patterns for p in (ROOT / top).rglob(pattern))


def _python_functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def _strip_cpp(text: str) -> str:
    """``text`` with comments, string and character literals blanked (line breaks kept)."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'', blank, text, flags=re.S)


def _cpp_functions(path: Path):
    """(head, first line, lines) of every C++ function body: a brace whose statement head (the text since
    the last ``;``, ``{`` or ``}``) has a parameter list and is no control statement, type or lambda."""
    text = _strip_cpp(path.read_text())
    head_start, opened = 0, []
    for i, ch in enumerate(text):
        if ch == "{":
            head = text[head_start:i].strip()
            words = re.findall(r"[A-Za-z_]\w*", head)
            is_function = (")" in head and words and words[0] not in CONTROL and "](" not in head.replace(" ", "")
                           and not head.startswith("[") and not re.search(r"=\s*\[", head))
            lead = len(text[head_start:i]) - len(text[head_start:i].lstrip())
            opened.append((head, text.count("\n", 0, head_start + lead) + 1 if is_function else None))
            head_start = i + 1
        elif ch == "}":
            head, first = opened.pop()
            if first is not None:
                last = text.count("\n", 0, i) + 1
                yield " ".join(head.split())[:80], first, last - first + 1
            head_start = i + 1
        elif ch == ";":
            head_start = i + 1


def test_files_stay_under_their_line_limits():
    too_long = [f"{p.relative_to(ROOT)}: {n} lines (limit {limit})" for top, limit in FILE_LIMITS.items()
                for p in _sources(top) if (n := len(p.read_text().splitlines())) >= limit]
    assert not too_long, "\n".join(too_long)


def test_functions_stay_under_80_lines():
    too_long = []
    for top in FILE_LIMITS:
        for p in _sources(top):
            found = _python_functions(p) if p.suffix == ".py" else _cpp_functions(p)
            too_long += [f"{p.relative_to(ROOT)}:{line}: {name} is {n} lines" for name, line, n in found
                         if n >= FUNCTION_LIMIT]
    assert not too_long, "\n".join(too_long)


def test_the_cpp_function_finder_sees_functions_and_nothing_else():
    sample = ROOT / "csrc" / "transport" / "arena.cpp"
    heads = [head for head, _, _ in _cpp_functions(sample)]
    assert any(h.startswith("Arena::Arena(") for h in heads), heads
    assert not any(h.split()[0] in CONTROL for h in heads), heads


def test_the_design_docs_module_map_names_every_module():
    """docs/design.md's module map is where a newcomer finds each room: every module of the library and
    every source of the extension is named there (by its file name)."""
    doc = (ROOT / "docs" / "design.md").read_text()
    table = doc[doc.index("## Module map"):doc.index("### The path of one all-gather")]
    sources = [p for p in sorted((ROOT / "tide").rglob("*.py")) if p.name != "__init__.py"]
    sources += sorted(p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".cu", ".h"))
    unnamed = [str(p.relative_to(ROOT)) for p in sources if not re.search(rf"\b{re.escape(p.stem)}\b", table)]
    assert not unnamed, unnamed


def _includes(path: Path) -> list[Path]:
    """The files of csrc/ that ``path`` includes (quoted includes, relative to csrc/)."""
    names = re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.M)
    return [ROOT / "csrc" / name for name in names]


def _reaches(start: Path) -> set[Path]:
    seen, todo = set(), [start]
    while todo:
        for included in _includes(todo.pop()):
            if included not in seen:
                seen.add(included)
                todo.append(included)
    return seen


def test_no_csrc_source_includes_a_header_above_its_own():
    """The extension's includes point down only: no .cpp/.cu includes a header that (directly or not) includes
    the source's own header, which would make the lower file depend on one built on it."""
    upward = []
    for source in _sources("csrc"):
        own = source.with_suffix(".h")
        if source.suffix in (".cpp", ".cu") and own.exists():
            upward += [f"{source.relative_to(ROOT)} -> {h.relative_to(ROOT)}" for h in _includes(source)
                       if h != own and own in _reaches(h)]
    assert not upward, upward


def test_an_include_back_up_is_caught():
    assert (ROOT / "csrc/transport/plans.h") in _reaches(ROOT / "csrc/transport/gate.h")


def _line_length() -> int:
    """``[tool.ruff] line-length`` of pyproject.toml (read by pattern: Python 3.10 has no tomllib)."""
    return int(re.search(r"^\[tool\.ruff\]\nline-length = (\d+)", (ROOT / "pyproject.toml").read_text(), re.M).group(1))


def test_python_lines_hold_the_projects_line_length():
    """ruff, configured in pyproject.toml, over every Python file of the checkout."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_csrc_lines_hold_the_projects_line_length():
    limit = _line_length()
    long = [f"{p.relative_to(ROOT)}:{n}" for p in _sources("csrc")
            for n, line in enumerate(p.read_text().splitlines(), 1) if len(line) > limit]
    assert not long, long


def test_the_design_docs_call_paths_name_code_that_exists():
    """docs/design.md's paths of one all-gather and one reduce-scatter name files, functions, verdicts and
    counters: each must exist, so a rename or a move that leaves the paths behind fails here."""
    doc = (ROOT / "docs" / "design.md").read_text()
    paths = doc[doc.index("### The path of one all-gather"):doc.index("## Layout plan")]
    python = "\n".join(p.read_text() for p in sorted((ROOT / "tide").rglob("*.py")))
    cpp = "\n".join(p.read_text() for p in _sources("csrc"))
    verdicts = re.search(r"kVerdicts = \{(.*?)\};", cpp, re.S).group(1)
    schemas = (ROOT / "tide" / "ops" / "schemas.py").read_text()
    missing = []
    for token in sorted(set(re.findall(r"`([^`]+)`", paths))):
        if re.fullmatch(r"[\w/]+\.(py|cpp|h|cu)", token):
            found = (ROOT / token).exists() or any(p.name == token for p in _sources("csrc"))
        elif token.startswith("torch.ops.tide."):
            found = f"{token.removeprefix('torch.ops.tide.')}(" in schemas
        else:
            name = re.split(r"[.:]+", token.split("(")[0])[-1]
            found = bool(re.search(rf"^\s*(def|class) {name}\b|^{name} = ", python, re.M)
                         or re.search(rf"\b{name}\(", cpp) or f'.def("{name}"' in cpp  # a binding
                         or f'"{name}"' in verdicts
                         or f'"{token}"' in python)  # a counter's name
        if not found:
            missing.append(token)
    assert not missing, missing
