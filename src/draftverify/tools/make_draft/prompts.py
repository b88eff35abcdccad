"""Training prompts for `make-draft`, written from templates, and the Python stdlib text they use.

Nothing here comes from the benchmark prompt sets. The instructions are the project's own
templates (explain, summarise, translate, code, math, QA, chat...); the passages, function
signatures and docstrings they quote come from the Python standard library installed with
the interpreter (`pydoc_data/topics.py` and stdlib source files, PSF License v2).
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from draftverify.tools.make_draft.prompt_words import (
    AUDIENCES,
    CODE_LANGUAGES,
    CODE_TASKS,
    FORMS,
    ITEMS,
    LANGUAGES,
    NAMES,
    QUESTIONS,
    ROLES,
    SENTENCES,
    TOPICS,
)

TEXT_LICENSE = "Python Software Foundation License Version 2 (text of the Python standard library and its pydoc topics)"

# Stdlib modules read as source (parsed with `ast`, never imported).
STDLIB_FILES = (
    "json/__init__.py",
    "json/decoder.py",
    "re/__init__.py",
    "pathlib.py",
    "collections/__init__.py",
    "functools.py",
    "datetime.py",
    "string.py",
    "textwrap.py",
    "random.py",
    "statistics.py",
    "fractions.py",
    "heapq.py",
    "bisect.py",
    "csv.py",
    "argparse.py",
    "logging/__init__.py",
    "dataclasses.py",
    "enum.py",
    "shutil.py",
    "subprocess.py",
    "threading.py",
    "queue.py",
    "urllib/parse.py",
    "difflib.py",
    "inspect.py",
    "contextlib.py",
    "copy.py",
    "pprint.py",
    "glob.py",
    "fnmatch.py",
    "tempfile.py",
    "zipfile.py",
    "base64.py",
    "uuid.py",
    "html/__init__.py",
    "calendar.py",
    "shlex.py",
    "configparser.py",
    "ipaddress.py",
    "gzip.py",
    "posixpath.py",
    "genericpath.py",
    "locale.py",
    "gettext.py",
    "colorsys.py",
    "operator.py",
    "graphlib.py",
    "secrets.py",
    "hmac.py",
    "mimetypes.py",
    "smtplib.py",
    "ftplib.py",
    "wave.py",
    "sched.py",
    "tokenize.py",
    "weakref.py",
    "abc.py",
    "numbers.py",
    "decimal.py",
    "email/utils.py",
    "http/cookies.py",
    "getopt.py",
    "typing.py",
    "timeit.py",
    "trace.py",
    "pydoc.py",
    "cmd.py",
    "code.py",
    "socketserver.py",
    "selectors.py",
)

TEMPLATES = (  # (weight, kind): which builder below renders the user turn
    (3, "explain"),
    (2, "write"),
    (2, "tips"),
    (2, "compare"),
    (2, "question"),
    (3, "code_task"),
    (3, "complete_code"),
    (2, "explain_code"),
    (1, "fix_code"),
    (2, "summarise"),
    (2, "translate"),
    (3, "math"),
    (1, "reason"),
    (1, "roleplay"),
    (1, "extract"),
    (2, "doc_qa"),
    (1, "chat"),
)


@dataclass
class Stdlib:
    """Text from the installed Python standard library: pydoc topics, docstrings and function sources."""

    topics: list[str]  # English reference passages
    functions: list[tuple[str, str, str]]  # (qualified name, header + docstring, full source)

    @classmethod
    @functools.cache
    def load(cls) -> "Stdlib":
        from pydoc_data.topics import topics

        passages = [text.strip() for _, text in sorted(topics.items()) if len(text.strip()) > 200]
        root = Path(sysconfig.get_paths()["stdlib"])
        functions = []
        for rel in STDLIB_FILES:
            path = root / rel
            if not path.is_file():
                continue
            source = path.read_text(encoding="utf-8", errors="replace")
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            lines = source.splitlines()
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
                    text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                    header = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])  # signature + docstring
                    if 60 < len(text) < 2500 and header.startswith("def "):
                        functions.append((f"{module}.{node.name}", header, text))
        return cls(passages, functions)

    def passage(self, rng: random.Random, max_chars: int = 1500) -> str:
        text = rng.choice(self.topics)
        start = rng.randrange(max(1, len(text) - max_chars)) if len(text) > max_chars else 0
        start = text.find("\n", start) + 1 if start else 0
        return text[start : start + max_chars].rsplit("\n", 1)[0].strip() or text[:max_chars]


def make_prompt(kind: str, rng: random.Random, lib: Stdlib) -> str:
    """One user turn of the given template kind, with random fillers. The draws' order is the data's identity
    (a seed gives the same prompts in every version): every kind after `code_task` draws a stdlib function."""
    topic = rng.choice(TOPICS)
    general = _general_prompt(kind, rng, topic)
    if general is not None:
        return general
    function = rng.choice(lib.functions)
    text = _text_prompt(kind, rng, lib, function)
    return text if text is not None else _reasoning_prompt(kind, rng, topic)


def _general_prompt(kind: str, rng: random.Random, topic: str) -> str | None:
    """Explain, write, tips, compare, question and code-task turns (None for the other kinds)."""
    if kind == "explain":
        return rng.choice(
            (
                "Explain {t} to {a}.",
                "What is {t}? Explain it to {a}.",
                "Can you describe how {t} works?",
                "Give me a short overview of {t}.",
            )
        ).format(t=topic, a=rng.choice(AUDIENCES))
    if kind == "write":
        return rng.choice(
            ("Write a {f} about {t}.", "Compose a {f} on the topic of {t}.", "Write a funny {f} about {t}.")
        ).format(f=rng.choice(FORMS), t=topic)
    if kind == "tips":
        return f"Give me {rng.randint(3, 7)} tips about {topic}."
    if kind == "compare":
        return f"Compare {topic} and {rng.choice(TOPICS)}. What do they have in common?"
    if kind == "question":
        return rng.choice(QUESTIONS)
    if kind == "code_task":
        lang = rng.choice(CODE_LANGUAGES)
        return rng.choice(
            (
                "Write a {l} function that {t}.",
                "In {l}, how do I write code that {t}?",
                "Implement a function in {l} that {t}. Include a short example.",
            )
        ).format(l=lang, t=rng.choice(CODE_TASKS))
    return None


def _text_prompt(kind: str, rng: random.Random, lib: Stdlib, function: tuple[str, str, str]) -> str | None:
    """Turns that quote stdlib text or code (None for the other kinds)."""
    name, header, source = function
    if kind == "complete_code":
        return (
            rng.choice(
                (
                    "Complete the code I provided.\n",
                    "Complete the following Python function:\n",
                    "Finish this function:\n\n",
                )
            )
            + header
            + "\n"
        )
    if kind == "explain_code":
        return f"Explain what this Python code does:\n```python\n{source}\n```"
    if kind == "fix_code":
        return f"Review this Python function and suggest improvements:\n```python\n{source}\n```"
    if kind == "summarise":
        return rng.choice(
            (
                "Summarize the following text in {n} sentences.\n\n{p}",
                "Summarize this:\n\n{p}",
                "{p}\n\nWhat is the main point of the text above?",
            )
        ).format(n=rng.randint(1, 4), p=lib.passage(rng))
    if kind == "translate":
        sentence = rng.choice(SENTENCES)
        return f"Translate the following sentence into {rng.choice(LANGUAGES)}: {sentence}"
    if kind == "extract":
        return f"List the key terms mentioned in the following text.\n\n{lib.passage(rng, 800)}"
    if kind == "doc_qa":
        short = name.rsplit(".", 1)[-1]
        question = f"what does `{short}` do, and when would I use it?"
        return f"Here is the documentation of `{name}`:\n\n{header}\n\nQuestion: {question}"
    return None


def _reasoning_prompt(kind: str, rng: random.Random, topic: str) -> str:
    """Math, reasoning and role-play turns, and plain chat for every other kind."""
    if kind == "math":
        a, b, c = rng.randint(2, 60), rng.randint(2, 25), rng.randint(2, 9)
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        return rng.choice(
            (
                f"{who} buys {a} {item}s for ${b} each and pays with a ${a * b + rng.randint(1, 50)} bill. "
                f"How much change does {who} get?",
                f"A train travels {a * 10} km in {c} hours. What is its average speed?",
                f"What is {a} times {b}, plus {c * 7}?",
                f"Solve for x: {c}x + {b} = {c * a + b}.",
                f"{who} has {a} {item}s and gives away {min(a, b)}. Then {who} buys {c} more. "
                f"How many {item}s does {who} have now?",
                f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
                f"If a shirt costs ${a * 3} and is on sale for {rng.choice((10, 20, 25, 50))}% off, "
                "what is the sale price?",
                f"{who} reads {b} pages a day. How many days does it take to read a book of {b * a} pages? "
                "Let's think step by step.",
            )
        )
    if kind == "reason":
        return rng.choice(
            (
                "If all {i}s are red and some red things are heavy, are some {i}s heavy? Explain.".format(
                    i=rng.choice(ITEMS)
                ),
                f"{rng.choice(NAMES)} is taller than {rng.choice(NAMES)}, who is taller than me. Who is the shortest?",
                "What comes next in the sequence 2, 4, 8, 16, ...? Explain your reasoning.",
                f"Is it a good idea to learn about {topic} before {rng.choice(TOPICS)}? Give reasons.",
            )
        )
    if kind == "roleplay":
        return f"Pretend you are {rng.choice(ROLES)}. Tell me about {topic}."
    return rng.choice(
        (
            "Hi! How are you today?",
            "I'm bored. Any ideas for what to do this afternoon?",
            f"I want to learn about {topic}. Where should I start?",
            "Tell me a joke.",
            f"What do you think about {topic}?",
            "Can you recommend a good book?",
        )
    )


def make_prompts(n: int, seed: int, lib: Stdlib) -> list[str]:
    """`n` user turns drawn from the weighted templates, reproducible from `seed`."""
    rng = random.Random(seed)
    kinds = [kind for weight, kind in TEMPLATES for _ in range(weight)]
    return [make_prompt(rng.choice(kinds), rng, lib) for _ in range(n)]


def make_documents(n: int, seed: int, lib: Stdlib) -> list[list[dict]]:
    """`n` chat conversations whose assistant turn is stdlib text (teacher-forced, not generated)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        if rng.random() < 0.5:
            name, _, source = rng.choice(lib.functions)
            user = f"Show me the source of `{name}`."
            answer = f"Here is the implementation:\n\n```python\n{source}\n```"
        else:
            user = rng.choice(
                (
                    "Tell me about this part of Python.",
                    "Explain the Python reference on this topic.",
                    "What does the Python documentation say here?",
                )
            )
            answer = lib.passage(rng)
        docs.append([{"role": "user", "content": user}, {"role": "assistant", "content": answer}])
    return docs
