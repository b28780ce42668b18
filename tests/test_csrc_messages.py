"""Error and warning messages of the CUDA extension stream no number through an ostream.

On the GPU machine (torch 2.11) a number formatted by an ostream inside the extension crashed the
process in libstdc++'s locale code (pytorch/pytorch#109923), so every
message argument of TORCH_CHECK / TORCH_WARN in csrc/ must be a string: a literal, ``num(...)``
(std::to_string), or one of the string-valued names and calls below. This test reads the sources.
"""
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
STRING_ARG = re.compile(
    r'^(?:"(?:[^"\\]|\\.)*"|\bop\b|\s)+$'  # literals, possibly joined with the op-name macro argument
    r'|^#\w+$'  # a stringised macro argument
    r'|^(?:num|c10::toString|cudaGetErrorString)\(.*\)$'
    r'|^(?:op|what|what_|name|graph_error_)$'
)


def _calls(text: str, macro: str):
    """The argument text of every ``macro(...)`` call (parentheses inside string literals skipped)."""
    for m in re.finditer(rf"\b{macro}\(", text):
        depth, i, in_str = 1, m.end(), False
        while depth:
            ch = text[i]
            if ch == '"' and text[i - 1] != "\\":
                in_str = not in_str
            elif not in_str:
                depth += {"(": 1, ")": -1}.get(ch, 0)
            i += 1
        yield text[m.end():i - 1]


def _split_top_level(args: str) -> list[str]:
    parts, depth, cur, in_str = [], 0, "", False
    for i, ch in enumerate(args):
        if ch == '"' and (i == 0 or args[i - 1] != "\\"):
            in_str = not in_str
        if not in_str:
            depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                parts.append(cur.strip())
                cur = ""
                continue
        cur += ch
    parts.append(cur.strip())
    return parts


def test_extension_messages_stream_only_strings():
    bad = []
    sources = sorted(CSRC.rglob("*.cpp")) + sorted(CSRC.rglob("*.cu")) + sorted(CSRC.rglob("*.h"))
    checked = 0
    for path in sources:
        text = path.read_text()
        for macro, skip in (("TORCH_CHECK", 1), ("TORCH_WARN", 0)):
            for call in _calls(text, macro):
                for arg in _split_top_level(call)[skip:]:
                    checked += 1
                    if not STRING_ARG.match(arg):
                        bad.append(f"{path.relative_to(CSRC)}: {macro}(... {arg} ...)")
    assert checked > 50, checked  # the scan found the extension's messages
    assert not bad, "message arguments that are not strings (wrap numbers in num()):\n" + "\n".join(bad)
