"""The prompt corpus of the self-distillation data: every kind of task of the 13 Spec-Bench categories, none of its prompts.

The target model answers these prompts (``training.distill_data``); a drafter trained on the answers learns to predict
the target. The corpus is written here, offline and deterministically (a seed), in three phases:

1. **seed**: the model writes material for the next phase: questions about a topic (factual, open, how-to),
   short news-style articles, short German passages;
2. **first turns**: task templates over topic lists (writing, roleplay, reasoning and math problems generated
   with random numbers, coding tasks, STEM and humanities questions), the questions the model wrote, and
   documents as contexts (summarise, extract, answer a question about a passage, several passages then a
   question as in retrieval-augmented QA, translate German to English). Documents are the model's own articles
   and passages of Python's language reference (``pydoc_data.topics``, shipped with CPython under the PSF
   licence, which allows this use);
3. **second turns**: a follow-up request after the model's first answer, for the multi-turn kinds (as MT-bench's
   second turns).

A prompt is a dict: ``id`` (stable, unique), ``kind`` (a Spec-Bench category), ``source`` (``template``,
``model-question``, ``model-article``, ``model-german``, ``python-docs``, ``seed``), ``phase``, ``messages`` (the
chat so far, the last one the user's) and ``split`` (``train`` or ``heldout``, by a hash of the id of the first
turn: a prompt's second turn is in its first turn's split). ``spec_bench_overlap`` drops any prompt sharing a run
of 8 words with a Spec-Bench turn: those prompts are the evaluation set.

>>> prompts = first_turn_prompts(seed=0, per_kind=2)
>>> sorted({p["kind"] for p in prompts}) == sorted(set(KINDS) - {"translation"})  # German passages come from phase 1
True
>>> len({p["id"] for p in prompts}) == len(prompts)
True
"""

from __future__ import annotations

import hashlib
import random
import re

KINDS = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
)
MULTI_TURN = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
HELDOUT_FRACTION = 0.05

TOPICS = [
    "a small fishing village",
    "the first day at a new school",
    "a lighthouse keeper",
    "urban gardening",
    "a city marathon",
    "a lost dog finding its way home",
    "the history of tea",
    "a night market",
    "a mountain rescue team",
    "public libraries",
    "a bakery that opens at 4 am",
    "electric scooters in cities",
    "a family reunion",
    "learning to play the violin",
    "a desert road trip",
    "volunteering at an animal shelter",
    "a village festival",
    "the life of honeybees",
    "a chess tournament",
    "a rainy afternoon in a museum",
    "a train journey across a continent",
    "recycling habits",
    "a beekeeper's year",
    "an old bookshop",
    "a winter storm",
    "remote work",
    "a neighborhood soccer team",
    "a science fair",
    "saving money as a student",
    "a hiking trail in autumn",
    "the invention of the bicycle",
    "a street musician",
    "moving to a new country",
    "a pottery class",
    "a farmers' market",
    "a power outage",
    "an astronaut's morning routine",
    "a shipwreck discovered by divers",
    "a robot vacuum",
    "a community theater play",
    "a cooking competition",
    "a camping trip gone wrong",
    "a friendship that began online",
    "a wildlife photographer",
    "the opening of a new bridge",
    "a school garden",
    "an apprentice carpenter",
    "a local election",
    "coral reefs",
    "a vintage car rally",
    "a snow day",
    "a jazz club",
    "a kite festival",
    "a startup's first customer",
    "a hospital night shift",
    "the migration of birds",
    "a village without internet",
    "a birthday surprise",
    "a bus driver's route",
    "a forgotten diary",
    "an island ferry",
    "a rooftop beehive",
    "a marathon runner's training",
    "a museum heist",
    "a flooded town",
    "a family recipe",
    "a new playground",
    "a solar-powered house",
    "an orchestra rehearsal",
    "a spelling bee",
    "a ski resort",
    "a tailor's shop",
    "a vegetable garden",
    "a bike repair cafe",
    "a planetarium show",
    "a thrift store",
    "a long-distance swimmer",
    "a newspaper delivery route",
    "a zoo keeper",
    "a harvest season",
    "a language exchange",
    "a midnight snack",
    "a fire drill",
]
STEM_CONCEPTS = [
    "photosynthesis",
    "plate tectonics",
    "the water cycle",
    "natural selection",
    "black holes",
    "entropy",
    "the immune system",
    "vaccines",
    "DNA replication",
    "chemical bonds",
    "Newton's laws of motion",
    "electric circuits",
    "magnetism",
    "climate change",
    "the greenhouse effect",
    "nuclear fission",
    "nuclear fusion",
    "the speed of light",
    "relativity",
    "quantum tunnelling",
    "semiconductors",
    "machine learning",
    "neural networks",
    "encryption",
    "prime numbers",
    "probability",
    "the Pythagorean theorem",
    "derivatives in calculus",
    "statistics and sampling",
    "ocean currents",
    "earthquakes",
    "volcanoes",
    "the solar system",
    "exoplanets",
    "antibiotic resistance",
    "the human heart",
    "sleep",
    "enzymes",
    "acids and bases",
    "the periodic table",
    "renewable energy",
    "batteries",
    "wind turbines",
    "GPS",
    "the internet",
    "compilers",
    "databases",
    "sorting algorithms",
    "computer memory",
    "lasers",
    "sound waves",
    "friction",
    "buoyancy",
    "orbits",
    "the carbon cycle",
    "ecosystems",
    "cell division",
]
HUMANITIES_THEMES = [
    "the causes of the French Revolution",
    "the role of trade in ancient Rome",
    "the printing press",
    "the Renaissance",
    "the Industrial Revolution",
    "the ethics of artificial intelligence",
    "free will",
    "the meaning of happiness",
    "justice",
    "the value of art",
    "inflation and interest rates",
    "supply and demand",
    "globalization",
    "the welfare state",
    "democracy and voting",
    "the Silk Road",
    "colonialism",
    "the Cold War",
    "human rights",
    "the philosophy of Socrates",
    "stoicism",
    "utilitarianism",
    "the role of museums",
    "language and thought",
    "the history of writing",
    "urbanization",
    "the role of religion in society",
    "education systems",
    "social media and politics",
    "the history of money",
    "minimum wage",
    "the tragedy of the commons",
    "the history of medicine",
    "modern architecture",
    "the role of the press",
    "migration",
    "cultural heritage",
    "the Enlightenment",
    "the origins of theater",
    "music and emotion",
    "poverty",
]
PERSONAS = [
    "a pirate captain",
    "a medieval knight",
    "a detective from the 1920s",
    "a famous chef",
    "a kindergarten teacher",
    "a grumpy wizard",
    "a space station commander",
    "a sports coach",
    "a tour guide in Rome",
    "a Victorian scientist",
    "a wise old tree",
    "a customer service agent",
    "a robot learning human emotions",
    "a stand-up comedian",
    "a nature documentary narrator",
    "a librarian",
    "a startup founder",
    "a ship's cat",
    "a time traveler from the future",
    "an ancient Greek philosopher",
    "a fitness trainer",
    "a cowboy",
    "a museum guard",
    "a travel vlogger",
    "a royal butler",
]
WRITING_FORMS = [
    "a short story",
    "a poem",
    "a blog post",
    "a persuasive essay",
    "a product description",
    "a letter to a friend",
    "a speech for a school assembly",
    "a formal email to a manager",
    "a diary entry",
    "a news report",
    "a limerick",
    "a movie pitch",
    "a restaurant review",
    "a haiku sequence",
    "a cover letter",
    "a motivational message",
    "a fairy tale",
]
CODING_TASKS = [
    "reverses the words in a sentence",
    "checks whether a string is a palindrome",
    "counts the vowels in a text",
    "merges two sorted lists",
    "finds the second largest number in a list",
    "removes duplicates while keeping order",
    "computes the factorial of n",
    "returns the n-th Fibonacci number iteratively",
    "checks whether a number is prime",
    "flattens a nested list",
    "groups words by their first letter",
    "converts Celsius to Fahrenheit",
    "finds the longest common prefix of a list of strings",
    "implements binary search",
    "implements bubble sort",
    "counts word frequencies in a text",
    "validates an email address with a regular expression",
    "transposes a matrix",
    "computes the greatest common divisor of two numbers",
    "rotates a list by k positions",
    "parses a CSV line",
    "checks whether brackets in a string are balanced",
    "finds all anagrams of a word in a list",
    "implements a stack class",
    "implements a queue with two stacks",
    "computes the running average of a stream",
    "converts a Roman numeral to an integer",
    "finds the most common element in a list",
    "chunks a list into pieces of size n",
    "computes the dot product of two vectors",
    "checks whether two strings are anagrams",
    "reads a JSON file and prints its keys",
    "generates all subsets of a set",
    "finds the missing number in a range",
    "computes the median of a list",
    "capitalizes every word in a string",
    "implements a simple LRU cache",
    "counts the lines in a file",
    "finds pairs of numbers that sum to a target",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust"]
NAMES = ["Ava", "Liam", "Maya", "Noah", "Zoe", "Omar", "Lena", "Ravi", "Sofia", "Ben", "Mia", "Kai", "Nora", "Ivan", "Priya", "Tom"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "tickets", "cupcakes", "stamps", "shells", "cards"]

FOLLOW_UPS = {
    "writing": [
        "Rewrite your previous response in exactly four sentences.",
        "Now make it more formal.",
        "Rewrite it for a ten-year-old reader.",
        "Give your text a title and summarize it in one sentence.",
        "Critique your own response and suggest two improvements.",
    ],
    "roleplay": [
        "What do you do on a typical weekend?",
        "What advice would you give to a young person?",
        "Tell me about the hardest day you ever had.",
        "How would you describe yourself in three words?",
    ],
    "reasoning": [
        "Explain your reasoning step by step again, more briefly.",
        "What would change if the numbers in the question were doubled?",
        "Are there any assumptions in your answer? List them.",
    ],
    "math": [
        "Check your answer by solving the problem another way.",
        "What would the answer be if every number in the problem were doubled?",
        "Explain the solution to someone who finds math hard.",
    ],
    "coding": [
        "Can you add comments and a short docstring?",
        "Write two test cases for your code.",
        "What is the time complexity of your solution? Can it be improved?",
        "Rewrite it without using any library functions.",
    ],
    "extraction": [
        "Return your previous answer as JSON.",
        "Now list only the three most important items.",
        "Add a one-sentence explanation for each item.",
    ],
    "stem": [
        "Explain it again as if I were five years old.",
        "Give a real-world example of this.",
        "What is a common misconception about this topic?",
    ],
    "humanities": [
        "Summarize your answer in three bullet points.",
        "What would a critic of this view say?",
        "Write a short poem that captures the main idea.",
    ],
}


def _pick(rng: random.Random, items: list[str]) -> str:
    return items[rng.randrange(len(items))]


def split_of(prompt_id: str) -> str:
    """``heldout`` for about 5% of first turns (by a hash of the id), else ``train``.

    >>> split_of("writing-template-00000") in ("train", "heldout")
    True
    """
    root = prompt_id.split("/t2")[0]
    bucket = int(hashlib.sha1(root.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if bucket < HELDOUT_FRACTION else "train"


def _prompt(pid: str, kind: str, source: str, phase: int, text: str) -> dict:
    return {
        "id": pid,
        "kind": kind,
        "source": source,
        "phase": phase,
        "messages": [{"role": "user", "content": text}],
        "split": split_of(pid),
    }


# ---- phase 1: the model writes material ----------------------------------------------------------------------------


def seed_prompts(seed: int = 0, questions: int = 600, articles: int = 300, german: int = 150) -> list[dict]:
    """Prompts whose answers become material of the first turns: questions, articles, German passages."""
    rng = random.Random(f"seed-{seed}")
    out = []
    styles = [
        ("qa", "Write one short factual question about {t} that has a short answer. Reply with the question only."),
        ("stem", "Write one question a curious student might ask about {t}. Reply with the question only."),
        ("humanities", "Write one thought-provoking question about {t}. Reply with the question only."),
        ("writing", "Write one creative writing request about {t}, as a user would ask an assistant. Reply with the request only."),
    ]
    pools = {"qa": TOPICS + STEM_CONCEPTS + HUMANITIES_THEMES, "stem": STEM_CONCEPTS, "humanities": HUMANITIES_THEMES, "writing": TOPICS}
    for i in range(questions):
        kind, template = styles[i % len(styles)]
        out.append(_prompt(f"seed-question-{i:05d}", kind, "seed", 1, template.format(t=_pick(rng, pools[kind]))))
    for i in range(articles):
        topic = _pick(rng, TOPICS + STEM_CONCEPTS + HUMANITIES_THEMES)
        out.append(
            _prompt(f"seed-article-{i:05d}", "summarization", "seed", 1, f"Write a short news article of about 150 words about {topic}.")
        )
    for i in range(german):
        topic = _pick(rng, TOPICS)
        out.append(
            _prompt(
                f"seed-german-{i:05d}",
                "translation",
                "seed",
                1,
                f"Write two short sentences in German about {topic}. Reply in German only.",
            )
        )
    return out


# ---- phase 2: first turns -------------------------------------------------------------------------------------------


def _reasoning(rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    kinds = [
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain.",
        f"In a race, {a} finished before {b} but after {c}. Who came second?",
        f"If every {rng.choice(ITEMS)[:-1]} in a box is red and {a} takes one item from the box, what color is it? Explain your reasoning.",
        f"{a} has twice as many siblings as {b}. {b} has {rng.randint(1, 4)} siblings. How many siblings does {a} have?",
        f"A clock shows {rng.randint(1, 11)}:{rng.choice(['00', '15', '30', '45'])}. "
        f"What time will it show after {rng.randint(2, 9)} hours and 30 minutes?",
        f"There are {rng.randint(3, 9)} people in a room and each shakes hands with every other person once. "
        "How many handshakes are there?",
        f"{a} says: 'I always lie.' Is this statement consistent? Explain.",
    ]
    return _pick(rng, kinds)


def _math(rng: random.Random) -> str:
    x, y, z = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    kinds = [
        f"Solve for x: {z}x + {x} = {z * y + x}.",
        f"What is the area of a rectangle with sides {x} cm and {y} cm? And its perimeter?",
        f"A triangle has vertices at (0, 0), ({x}, 0) and (0, {y}). What is its area?",
        f"What is {x}% of {y * 10}?",
        f"Find the sum of all integers from 1 to {x * 5}.",
        f"What is the probability of rolling a total of {rng.randint(3, 11)} with two fair dice?",
        f"Simplify the fraction {x * z}/{y * z}.",
        f"If f(x) = {z}x^2 - {x}, what is f({rng.randint(1, 6)})?",
    ]
    return _pick(rng, kinds)


def _word_problem(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    item = _pick(rng, ITEMS)
    n, m, p = rng.randint(5, 60), rng.randint(2, 12), rng.randint(2, 9)
    price = rng.randint(2, 15)
    kinds = [
        f"{a} has {n} {item}. {a} gives {m} {item} to {b} and then buys {p} times as many as {a} gave away. "
        f"How many {item} does {a} have now?",
        f"{a} buys {m} packs of {item} at ${price} each and pays with a ${price * m + rng.randint(1, 20)} bill. "
        f"How much change does {a} get?",
        f"A class of {n} students is split into groups of {p}. How many full groups are there, and how many students are left over?",
        f"{a} reads {m} pages a day. How many days does it take to read a book of {m * n} pages?",
        f"{a} earns ${price * 3} per hour and works {m} hours a week. How much does {a} earn in {p} weeks?",
        f"A store sells {item} for ${price} each. On Saturday it sold {n} and on Sunday {m} fewer than on Saturday. "
        "How much money did it make?",
    ]
    return _pick(rng, kinds)


def _templated(kind: str, rng: random.Random) -> str:
    if kind == "writing":
        return f"Write {_pick(rng, WRITING_FORMS)} about {_pick(rng, TOPICS)}."
    if kind == "roleplay":
        persona = _pick(rng, PERSONAS)
        ask = _pick(rng, ["What do you think about", "Tell me a story about", "Give me advice on"])
        return f"Pretend you are {persona} and stay in character. {ask} {_pick(rng, TOPICS)}."
    if kind == "reasoning":
        return _reasoning(rng)
    if kind == "math":
        return _math(rng)
    if kind == "coding":
        return f"Write a {_pick(rng, LANGUAGES)} function that {_pick(rng, CODING_TASKS)}."
    if kind == "stem":
        forms = [
            "Explain {c}.",
            "How does {c} work?",
            "Why is {c} important?",
            "What is {c}? Give an example.",
            "Describe {c} in simple terms.",
        ]
        return _pick(rng, forms).format(c=_pick(rng, STEM_CONCEPTS))
    if kind == "humanities":
        forms = ["Discuss {c}.", "What can we learn from {c}?", "Explain the significance of {c}.", "Compare two views on {c}."]
        return _pick(rng, forms).format(c=_pick(rng, HUMANITIES_THEMES))
    if kind == "qa":
        forms = [
            "In one sentence, what is {c}?",
            "Who is best known for work on {c}?",
            "Name one surprising fact about {c}.",
            "When did people first study {c}?",
        ]
        return _pick(rng, forms).format(c=_pick(rng, STEM_CONCEPTS + HUMANITIES_THEMES))
    if kind == "math_reasoning":
        return _word_problem(rng)
    raise KeyError(kind)


def python_docs_passages(max_chars: int = 1200) -> list[tuple[str, str]]:
    """(topic, passage) from Python's language reference shipped with CPython (PSF licence), cut at paragraphs."""
    import pydoc_data.topics as topics

    out = []
    for name in sorted(topics.topics):
        text = re.sub(r"\n{3,}", "\n\n", topics.topics[name]).strip()
        chunk = ""
        for para in text.split("\n\n"):
            if len(chunk) + len(para) > max_chars and chunk:
                out.append((name, chunk.strip()))
                chunk = ""
            chunk += para + "\n\n"
        if chunk.strip():
            out.append((name, chunk.strip()))
    return [(n, p) for n, p in out if len(p) > 200]


def first_turn_prompts(seed: int = 0, per_kind: int = 400, material: list[dict] | None = None) -> list[dict]:
    """Templates over topic lists (``per_kind`` each for the kinds they cover), and prompts built from the phase-1
    ``material`` (the model's questions, articles, German passages; rows with ``kind``, ``id``, ``source`` and
    ``text``) and Python's reference (summaries, extraction, QA on a passage, RAG)."""
    rng = random.Random(f"first-{seed}")
    out = []
    for kind in ("writing", "roleplay", "reasoning", "math", "coding", "stem", "humanities", "qa", "math_reasoning"):
        for i in range(per_kind):
            out.append(_prompt(f"{kind}-template-{i:05d}", kind, "template", 2, _templated(kind, rng)))
    docs = python_docs_passages()
    rng.shuffle(docs)
    articles = [m for m in material or [] if m["source"] == "model-article"]
    questions = [m for m in material or [] if m["source"] == "model-question"]
    german = [m for m in material or [] if m["source"] == "model-german"]
    passages = [("python-docs", f"{name}: {text}") for name, text in docs] + [("model-article", m["text"]) for m in articles]
    rng.shuffle(passages)
    extract_asks = [
        "List the key facts from the text below as bullet points.",
        "Extract every name, number and date mentioned in the following text.",
        "Read the text below and list its three main points.",
        "From the following text, extract the technical terms and define each briefly.",
    ]
    for i in range(min(per_kind, len(passages))):
        source, text = passages[i]
        out.append(_prompt(f"summarization-{source}-{i:05d}", "summarization", source, 2, f"Summarize: {text}"))
        source, text = passages[(i + per_kind // 2) % len(passages)]
        out.append(_prompt(f"extraction-{source}-{i:05d}", "extraction", source, 2, f"{_pick(rng, extract_asks)}\n\n{text}"))
        picked = [passages[(i * 3 + j) % len(passages)][1] for j in range(3)]
        question = questions[i % len(questions)]["text"] if questions else "What is the main idea of these passages?"
        out.append(_prompt(f"rag-{source}-{i:05d}", "rag", source, 2, "\n".join(picked) + "\n" + question))
    for i, m in enumerate(questions):
        out.append(_prompt(f"{m['kind']}-model-question-{i:05d}", m["kind"], "model-question", 2, m["text"]))
    for i, m in enumerate(german):
        out.append(
            _prompt(f"translation-model-german-{i:05d}", "translation", "model-german", 2, f"Translate German to English: {m['text']}")
        )
    return [p for p in out if p["messages"][0]["content"].strip()]


def material_from_answers(rows: list[dict]) -> list[dict]:
    """Phase-1 answers as first-turn material: cleaned questions, articles and German passages.

    ``rows``: ``{"id", "kind", "answer_text", "finish_reason"}`` of seed prompts.
    """
    out = []
    for r in rows:
        text = r["answer_text"].strip()
        if not text:
            continue
        pid = r["id"]
        if pid.startswith("seed-question-"):
            line = text.splitlines()[0].strip().strip('"')
            if 10 <= len(line) <= 300 and line.endswith(("?", ".")):
                out.append({"id": pid, "kind": r["kind"], "source": "model-question", "text": line})
        elif pid.startswith("seed-article-") and len(text) > 200:
            out.append({"id": pid, "kind": "summarization", "source": "model-article", "text": text})
        elif pid.startswith("seed-german-") and 20 <= len(text) <= 600:
            out.append({"id": pid, "kind": "translation", "source": "model-german", "text": " ".join(text.split())})
    return out


# ---- phase 3: second turns -------------------------------------------------------------------------------------------


def second_turn_prompts(first: list[dict], seed: int = 0, fraction: float = 0.5) -> list[dict]:
    """Follow-ups after the model's first answer for about ``fraction`` of the multi-turn first turns.

    ``first``: ``{"id", "kind", "source", "messages", "answer_text", "finish_reason", "split"}`` rows of phase 2.
    """
    rng = random.Random(f"second-{seed}")
    out = []
    for r in sorted(first, key=lambda r: r["id"]):
        if r["kind"] not in MULTI_TURN or not r["answer_text"].strip() or rng.random() >= fraction:
            continue
        follow = _pick(rng, FOLLOW_UPS[r["kind"]])
        messages = list(r["messages"]) + [{"role": "assistant", "content": r["answer_text"]}, {"role": "user", "content": follow}]
        pid = f"{r['id']}/t2"
        out.append({"id": pid, "kind": r["kind"], "source": r["source"], "phase": 3, "messages": messages, "split": split_of(pid)})
    return out


# ---- no evaluation prompt in the corpus ----------------------------------------------------------------------------


def _shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def spec_bench_overlap(prompts: list[dict], spec_bench_turns: list[str], n: int = 8) -> list[dict]:
    """The prompts that share a run of ``n`` words with a Spec-Bench turn (to be dropped)."""
    bench = set()
    for turn in spec_bench_turns:
        bench |= _shingles(turn, n)
    return [p for p in prompts if any(_shingles(m["content"], n) & bench for m in p["messages"] if m["role"] == "user")]
