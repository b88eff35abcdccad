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

TOPICS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the French Revolution",
    "compound interest",
    "vaccines",
    "climate change",
    "the immune system",
    "machine learning",
    "blockchain",
    "the stock market",
    "volcanoes",
    "the Roman Empire",
    "plate tectonics",
    "DNA replication",
    "supply and demand",
    "renewable energy",
    "the internet",
    "quantum computing",
    "the theory of evolution",
    "inflation",
    "meditation",
    "sleep",
    "the solar system",
    "electric cars",
    "recycling",
    "the printing press",
    "democracy",
    "artificial intelligence",
    "the human heart",
    "earthquakes",
    "coffee",
    "jazz music",
    "the Great Wall of China",
    "honey bees",
    "the Olympic Games",
    "social media",
    "time management",
    "public speaking",
    "healthy eating",
    "gravity",
    "the moon landing",
    "the Renaissance",
    "cryptography",
    "rainforests",
    "ocean tides",
    "antibiotics",
    "the Industrial Revolution",
    "photography",
    "chess",
    "gardening",
    "remote work",
    "the speed of light",
    "operating systems",
    "databases",
    "version control with git",
    "unit testing",
    "recursion",
    "hash tables",
    "sorting algorithms",
    "the TCP/IP model",
    "encryption",
    "cloud computing",
    "neural networks",
    "probability",
    "prime numbers",
    "the Pythagorean theorem",
    "statistics",
    "linear algebra",
    "calculus",
    "the periodic table",
    "chemical reactions",
    "magnetism",
    "nutrition",
    "exercise",
    "friendship",
    "leadership",
    "negotiation",
    "budgeting",
    "learning a new language",
    "writing a resume",
    "job interviews",
    "traveling on a budget",
    "urban planning",
    "bridges",
    "airplanes",
    "the history of writing",
    "mythology",
    "the Cold War",
)
FORMS = (
    "poem",
    "short story",
    "blog post",
    "email",
    "speech",
    "product description",
    "haiku",
    "limerick",
    "letter",
    "diary entry",
    "news article",
    "advertisement",
    "dialogue",
    "song",
    "review",
    "tweet",
)
AUDIENCES = ("a five-year-old", "a high school student", "a beginner", "an expert", "a busy manager", "my grandmother")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese", "Russian")
ROLES = (
    "a pirate captain",
    "a medieval knight",
    "a travel guide",
    "a chef",
    "a detective",
    "a teacher",
    "a doctor",
    "a startup founder",
    "a museum curator",
    "an astronaut",
    "a librarian",
    "a personal trainer",
)
NAMES = ("Alice", "Bob", "Maria", "John", "Priya", "Chen", "Fatima", "Lucas", "Emma", "Omar", "Sofia", "Liam")
ITEMS = ("apple", "notebook", "pencil", "cookie", "ticket", "book", "shirt", "cupcake", "toy car", "plant")
CODE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the vowels in a string",
    "merges two sorted lists",
    "removes duplicates from a list while keeping order",
    "finds the largest element of a list",
    "checks whether a string is a palindrome",
    "computes the factorial of n",
    "flattens a nested list",
    "returns the most common word in a text",
    "converts Celsius to Fahrenheit",
    "sorts a list of dictionaries by a key",
    "computes the greatest common divisor of two numbers",
    "checks whether two strings are anagrams",
    "returns all prime numbers below n",
    "implements binary search",
    "reads a CSV file and returns its rows",
    "counts the lines of a file",
    "transposes a matrix",
    "finds the second largest number in a list",
    "capitalizes every word of a sentence",
    "computes the mean and median",
    "validates an email address",
    "returns the sum of the digits of an integer",
    "rotates a list by k positions",
    "groups words by their first letter",
    "implements a stack class",
    "implements a queue with two stacks",
    "finds the longest common prefix of a list of strings",
    "converts a Roman numeral to an integer",
    "computes the running sum of a list",
    "checks whether brackets in a string are balanced",
    "returns the intersection of two lists",
    "computes the power set of a list",
    "converts a number to binary",
    "finds all pairs in a list that sum to a target",
    "returns the length of the longest word",
    "computes the dot product of two vectors",
    "chunks a list into pieces of size n",
)
CODE_LANGUAGES = ("Python", "Python", "Python", "JavaScript", "C", "Java", "Rust", "Go", "SQL", "Bash")
QUESTIONS = (
    "Why is the sky blue?",
    "How do airplanes stay in the air?",
    "What causes the seasons?",
    "How does a refrigerator work?",
    "Why do we dream?",
    "What is the difference between weather and climate?",
    "How do vaccines work?",
    "What is the capital of Australia and why was it chosen?",
    "How does the internet work?",
    "Why do cats purr?",
    "What is a black hole?",
    "How do I make a good cup of tea?",
    "What is the meaning of life?",
    "How are rainbows formed?",
    "What is the difference between a virus and a bacterium?",
    "How does a computer store numbers?",
    "Who invented the telephone?",
    "Why is exercise good for you?",
    "How do I learn to code?",
    "What is an API?",
    "What is the difference between a list and a tuple in Python?",
    "How can I improve my memory?",
    "Why do leaves change color in autumn?",
    "What is the tallest mountain in the world?",
    "How do magnets work?",
    "What are the benefits of reading books?",
    "How do I stay motivated?",
    "What is the largest planet?",
    "How do birds know where to migrate?",
    "What is a good way to save money?",
)
SENTENCES = (
    "The weather is beautiful today.",
    "I would like to order a cup of coffee, please.",
    "Where is the train station?",
    "My brother is learning to play the guitar.",
    "We are going to the beach this weekend.",
    "This book is very interesting.",
    "Can you help me find my keys?",
    "The meeting has been moved to Thursday.",
    "She works as a nurse at the hospital.",
    "I have been living in this city for five years.",
    "The children are playing in the garden.",
    "Please turn off the lights when you leave.",
    "How much does this jacket cost?",
    "The museum opens at nine o'clock.",
    "He forgot his umbrella at home.",
    "Learning a new language takes time and patience.",
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
    """One user turn of the given template kind, with random fillers."""
    topic = rng.choice(TOPICS)
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
    name, header, source = rng.choice(lib.functions)
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
    if kind == "math":
        a, b, c = rng.randint(2, 60), rng.randint(2, 25), rng.randint(2, 9)
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        return rng.choice(
            (
                f"{who} buys {a} {item}s for ${b} each and pays with a ${a * b + rng.randint(1, 50)} bill. How much change does {who} get?",
                f"A train travels {a * 10} km in {c} hours. What is its average speed?",
                f"What is {a} times {b}, plus {c * 7}?",
                f"Solve for x: {c}x + {b} = {c * a + b}.",
                f"{who} has {a} {item}s and gives away {min(a, b)}. Then {who} buys {c} more. How many {item}s does {who} have now?",
                f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
                f"If a shirt costs ${a * 3} and is on sale for {rng.choice((10, 20, 25, 50))}% off, what is the sale price?",
                f"{who} reads {b} pages a day. How many days does it take to read a book of {b * a} pages? Let's think step by step.",
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
    if kind == "extract":
        return f"List the key terms mentioned in the following text.\n\n{lib.passage(rng, 800)}"
    if kind == "doc_qa":
        return f"Here is the documentation of `{name}`:\n\n{header}\n\nQuestion: what does `{name.rsplit('.', 1)[-1]}` do, and when would I use it?"
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
