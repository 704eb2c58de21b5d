"""The user pages stay true to the repository: every relative link in README.md and docs/*.md
names a file that exists (and, with an anchor, a heading of that file), and every ``poseidon ...``
command shown in a code block parses with the real command-line parser (parsed, never run).

Fast and torch-free; mkdocs is not needed (``make docs`` builds the site with ``--strict``)."""
from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from poseidon_plugin.errors import PoseidonError

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_SHELL_STOP = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}


def _split(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, list[str]]]]:
    """(prose lines with their numbers, code blocks as (first line number, lines))."""
    prose, blocks, block, start = [], [], None, 0
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            if block is None:
                block, start = [], n + 1
            else:
                blocks.append((start, block))
                block = None
            continue
        if block is None:
            prose.append((n, line))
        else:
            block.append(line)
    return prose, blocks


# ---- links -----------------------------------------------------------------------------------

def _slug_mkdocs(title: str) -> str:
    """Python-Markdown's toc slugify (what mkdocs uses)."""
    value = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _slug_github(title: str) -> str:
    """GitHub's heading anchors: lower case, punctuation dropped, each space a hyphen."""
    value = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return value.replace(" ", "-")


def _heading_text(raw: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", raw)                 # code spans keep their text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    return re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1", text).strip().rstrip("#").strip()


def anchors(text: str) -> set[str]:
    """The anchors both GitHub and mkdocs give the headings of a page (duplicates numbered the
    way each of them does: GitHub ``-1``, mkdocs ``_1``)."""
    prose, _ = _split(text)
    gh: dict[str, int] = {}
    mk: dict[str, int] = {}
    out_gh, out_mk = set(), set()
    for _, line in prose:
        m = re.match(r"^ {0,3}#{1,6}\s+(.*)$", line)
        if not m:
            continue
        title = _heading_text(m.group(1))
        for slug, seen, out, sep in ((_slug_github(title), gh, out_gh, "-"),
                                     (_slug_mkdocs(title), mk, out_mk, "_")):
            k = seen.get(slug, 0)
            out.add(slug if k == 0 else f"{slug}{sep}{k}")
            seen[slug] = k + 1
    return out_gh & out_mk


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """Each relative link of ``page`` that names no file, or a heading its file lacks."""
    text = page.read_text(encoding="utf-8") if text is None else text
    prose, _ = _split(text)
    bad = []
    for n, line in prose:
        for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{n}"
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{where}: {target}: no such file")
                continue
            if anchor and dest.suffix == ".md":
                own = text if dest == page else dest.read_text(encoding="utf-8")
                if anchor not in anchors(own):
                    bad.append(f"{where}: {target}: no heading with that anchor")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_link_check_catches_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# Title\n\n## Two words\n")
    text = ("see [there](there.md), [a part](there.md#two-words), [up](#top),\n"
            "[gone](missing.md) and [bad part](there.md#three-words) and "
            "![img](images/none.png), [web](https://example.org/x.md)\n"
            "`[code](not-a-link.md)`\n\n```\n[in code](also-not.md)\n```\n\n# Top\n")
    page.write_text(text)
    bad = broken_links(page)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "missing.md: no such file", "there.md#three-words: no heading with that anchor",
        "images/none.png: no such file"]


def test_anchors_follow_github_and_mkdocs():
    text = "# Plan stability\n## `--ep` and `--cp`\n## Set-up: two commands\n## Twice\n## Twice\n"
    got = anchors(text)
    assert {"plan-stability", "set-up-two-commands", "twice"} <= got
    # the two sites disagree on runs of hyphens ("--ep-and---cp" / "-ep-and-cp") and on how a
    # repeated heading is numbered ("twice-1" / "twice_1"): such an anchor works on one only
    assert not {"--ep-and---cp", "-ep-and-cp", "twice-1", "twice_1"} & got


# ---- commands --------------------------------------------------------------------------------

def commands(text: str) -> list[tuple[int, list[str]]]:
    """Every ``poseidon ...`` (or ``-m poseidon_plugin[.cli] ...``) command in the code
    blocks of a page: (line number, the arguments after the program name). Continuation lines
    are joined, comments and what follows a pipe or a redirection dropped."""
    out = []
    for n, line in code_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for k, w in enumerate(words):
            prog = None
            if w.split("/")[-1] == "poseidon":
                prog = k + 1
            elif w == "-m" and words[k + 1:k + 2] in (["poseidon_plugin"],
                                                      ["poseidon_plugin.cli"]):
                prog = k + 2
            if prog is None:
                continue
            args = []
            for a in words[prog:]:
                if a in _SHELL_STOP:
                    break
                args.append(a)
            out.append((n, args))
            break
    return out


def code_lines(text: str):
    """(line number, line) of every code-block line of a page, continuation lines joined."""
    _, blocks = _split(text)
    for start, lines in blocks:
        i = 0
        while i < len(lines):
            n, line = start + i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            yield n, line


def parse_error(args: list[str]) -> str | None:
    """What the real parser says of ``poseidon <args>`` (None: it parses)."""
    from poseidon_plugin import cli

    argv = cli._glue_megatron_args(list(args))
    if any(a in ("-h", "--help") for a in argv):
        argv = [a for a in argv if a not in ("-h", "--help")]
        if not argv:
            return None
        if argv[0] in ("plan", "profile", "validate") and len(argv) == 1:
            return None
    if argv[:1] == ["validate"]:
        return None            # its options are the validation's own (poseidon validate --help)
    try:
        ns = cli._build_parser().parse_args(argv)
    except PoseidonError as exc:
        return str(exc)
    except SystemExit as exc:  # pragma: no cover - the parser raises PoseidonError
        return f"exit {exc.code}"
    if ns.command is None:
        return "no command"
    return None


def _page_commands():
    for page in PAGES:
        for n, args in commands(page.read_text(encoding="utf-8")):
            yield pytest.param(args, id=f"{page.relative_to(ROOT)}:{n}")


def test_pages_show_poseidon_commands():
    found = list(_page_commands())
    assert any(p.values[0][:1] == ["plan"] for p in found)
    assert any(p.values[0][:1] == ["profile"] for p in found)


@pytest.mark.parametrize("args", list(_page_commands()))
def test_shown_commands_parse(args):
    assert parse_error(args) is None, f"poseidon {shlex.join(args)}"


def test_command_check_catches_a_bad_flag():
    text = ("```bash\n"
            ".venv/bin/poseidon plan --cluster c.yaml --model llama3-8b \\\n"
            "    --global-batch-size 128 --seq-length 4096 --jsn   # typo\n"
            "poseidon plan --cluster c.yaml --model llama3-8b --global-batch-size 8 --seq-length 64"
            " | head\n"
            "python -m poseidon_plugin.cli profile --model llama3-8b -o db.json --tp two\n"
            "echo poseidon: INFO: not a command\n"
            "torchrun --nproc-per-node 2 -m poseidon_plugin profile -o db.json --tp 1 2\n"
            "```\n")
    found = commands(text)
    assert [n for n, _ in found] == [2, 4, 5, 7]
    assert found[0][1][-1] == "--jsn" and found[1][1][-1] == "64"
    errors = [parse_error(args) for _, args in found]
    assert errors[0] is not None and "--jsn" in errors[0]
    assert errors[1] is None
    assert errors[2] is not None and "two" in errors[2]
    assert found[3][1][:1] == ["profile"] and errors[3] is None


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no section '## {title}'"
    return m.group(1)


def test_site_landing_page_keeps_the_readme_figures():
    """docs/index.md (the site's landing page) repeats the README's headline figures: the same
    rows, the links aside (the README's docs/X.md is the site's X.md)."""
    readme = _section((ROOT / "README.md").read_text(encoding="utf-8"), "Headline figures")
    index = _section((ROOT / "docs" / "index.md").read_text(encoding="utf-8"), "Headline figures")
    assert re.sub(r"(\]\(|\[)docs/", r"\1", readme) == index


# ---- the launch's --poseidon-* options -------------------------------------------------------

_POSEIDON_FLAG = re.compile(r"--poseidon-[a-z0-9-]*[a-z0-9]")


def unknown_launch_flags(text: str) -> list[str]:
    """The ``--poseidon-*`` names a page mentions (prose, tables, code) that the launch does not
    know."""
    from poseidon_plugin.megatron.launch.options import _SPEC

    return sorted({f for f in _POSEIDON_FLAG.findall(text) if f not in _SPEC})


def launch_lines(text: str) -> list[tuple[int, list[str]]]:
    """The code-block lines (continuations joined) that pass ``--poseidon-*`` options."""
    out = []
    for n, line in code_lines(text):
        if "--poseidon-" not in line:
            continue
        try:
            out.append((n, shlex.split(line, comments=True)))
        except ValueError:
            continue
    return out


def launch_error(words: list[str]) -> str | None:
    from poseidon_plugin.megatron.launch.options import extract_options

    try:
        extract_options(words)
    except PoseidonError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_launch_options_shown_exist(page):
    text = page.read_text(encoding="utf-8")
    assert unknown_launch_flags(text) == []
    bad = [f"{page.name}:{n}: {err}" for n, words in launch_lines(text)
           if (err := launch_error(words)) is not None]
    assert bad == []


def test_launch_option_check_catches_a_bad_option():
    text = ("Use `--poseidon-dry-run` or --poseidon-dryrun.\n\n```bash\n"
            "torchrun ... -m poseidon_plugin.launch pretrain_gpt.py <your args> --poseidon-auto \\\n"
            "    --poseidon-pruning fastest\n"
            "torchrun ... pretrain_gpt.py --poseidon-auto --poseidon-time-budget 30\n```\n")
    assert unknown_launch_flags(text) == ["--poseidon-dryrun"]
    found = launch_lines(text)
    assert [n for n, _ in found] == [4, 6]
    assert "--poseidon-pruning" in launch_error(found[0][1])
    assert launch_error(found[1][1]) is None


def test_example_outputs_of_the_readme_and_usage_are_ignored_by_git():
    """``--out plan.json`` / ``--gantt plan.png`` in the README's and usage.md's examples write
    into the clone: git must not offer them for a commit."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (or no git)")
    outputs = set()
    for page in (ROOT / "README.md", ROOT / "docs" / "usage.md"):
        outputs.update(m.group(1) for m in re.finditer(r"--(?:out|gantt) (\S+\.\w+)",
                                                       page.read_text()))
    outputs = {o for o in outputs if "/" not in o}
    assert {"plan.json", "plan.png"} <= outputs
    for name in sorted(outputs):
        rc = subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT).returncode
        assert rc == 0, f"{name} (an example's output) is not in .gitignore"


def test_readme_says_where_the_framework_trees_come_from_and_what_make_test_builds():
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "`FRAMEWORKS` defaults to `../shared/frameworks`" in text
    assert "`PROVENANCE.md`" in text and "`.msllm/`" in text and "du -sh .msllm" in text
