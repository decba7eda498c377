"""What a truncated conversation still lets the model know: seeded synthetic conversations
that plant facts early and an instruction in the system prompt, then talk of other things,
then ask about the facts; and the measures of the answers (pure, no servers).

Each conversation opens with the user stating facts (a name, a pet, a city, a number, a
preference) and the assistant acknowledging them, goes on for ``filler_rounds`` exchanges
on unrelated topics (canned answers: the history is given, not generated), and ends with
one question per fact. The system prompt asks for a marker word in every answer, so that
whether the instruction survived can be read off the answers.
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass

import sacrebleu
from rouge_score import rouge_scorer

from llmmesh.types import Role, Turn

NAMES = ["Amara", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiro", "Ines",
         "Joaquin", "Kalani", "Lior", "Mireille", "Nnamdi", "Oksana", "Priya", "Quentin",
         "Rosalind", "Soren", "Tamsin"]  # fmt: skip
PETS = ["Biscuit", "Pepper", "Mochi", "Juniper", "Waffles", "Clementine", "Bramble",
        "Noodle", "Saffron", "Pickles"]  # fmt: skip
ANIMALS = ["dog", "cat", "parrot", "rabbit", "tortoise"]
CITIES = ["Porto", "Tallinn", "Valparaiso", "Kyoto", "Ljubljana", "Hobart", "Marrakesh",
          "Bergen", "Cusco", "Tbilisi"]  # fmt: skip
COLOURS = ["teal", "crimson", "mustard", "lavender", "olive", "turquoise", "maroon", "coral"]
DISHES = ["paella", "ramen", "pierogi", "falafel", "risotto", "goulash", "pho", "tagine"]
MARKERS = ["Cheers", "Onward", "Splendid", "Indeed"]

FILLER = [
    ("How often should I water a snake plant?",
     "About every two to three weeks. Let the soil dry out completely between waterings, "
     "and water even less in winter."),
    ("What is a good way to start running?",
     "Begin with run-walk intervals of one minute each for twenty minutes, three times a "
     "week, and add a minute of running each week."),
    ("Can you explain what a mortgage rate is?",
     "It is the interest a lender charges on a home loan, either fixed for the whole term "
     "or variable with a reference rate."),
    ("Why is the sky blue?",
     "Sunlight scatters off air molecules, and shorter blue wavelengths scatter much more "
     "than red ones, so blue light reaches us from every direction."),
    ("How do I make my bread rise more?",
     "Give the dough more time in a warm place, check that the yeast is fresh, and knead "
     "long enough to build the gluten."),
    ("What should I pack for a weekend hike?",
     "Water, snacks, a rain jacket, a warm layer, a map, a first aid kit, sun protection "
     "and a charged phone."),
    ("How can I sleep better?",
     "Keep a regular schedule, avoid screens and caffeine late in the day, and keep the "
     "bedroom dark, quiet and cool."),
    ("What is the difference between weather and climate?",
     "Weather is what the atmosphere does over hours and days; climate is the average of "
     "that weather over decades."),
    ("How do I remove a coffee stain from a shirt?",
     "Rinse it with cold water from the back, apply a little liquid detergent, let it sit "
     "for a few minutes and wash as usual."),
    ("Is it worth learning to touch type?",
     "Yes: a few weeks of short daily practice usually doubles typing speed and frees your "
     "eyes from the keyboard."),
    ("What makes a good cover letter?",
     "It is short, names the role, shows two or three achievements that match it, and "
     "ends with a clear next step."),
    ("How do noise cancelling headphones work?",
     "Microphones pick up outside sound and the headphones play the inverted wave, which "
     "cancels much of the low, steady noise."),
    ("Why do leaves change colour in autumn?",
     "Trees stop making green chlorophyll as days shorten, which reveals yellow pigments "
     "and lets some species make red ones."),
    ("How should I store fresh herbs?",
     "Keep soft herbs like parsley in a glass of water in the fridge, and wrap hard herbs "
     "like rosemary in a damp towel."),
    ("What is compound interest?",
     "Interest earned on both the original amount and the interest already added, so "
     "savings grow faster over time."),
    ("How do I keep a conversation going with someone new?",
     "Ask open questions, listen for details you can follow up on, and share a little "
     "about yourself in return."),
    ("What is the best way to learn a new language?",
     "Practise a little every day, speak with others early, and learn the most common "
     "words and phrases first."),
    ("How do I choose a good watermelon?",
     "Pick one that feels heavy for its size, with a creamy yellow spot where it lay on "
     "the ground and a dull rind."),
    ("Why do cats purr?",
     "Mostly to signal contentment, but also to soothe themselves when stressed or hurt; "
     "the vibration may even help healing."),
    ("How can I focus while working from home?",
     "Keep a fixed start time, a separate work spot, short planned breaks and a list of "
     "the day's three main tasks."),
]  # fmt: skip


@dataclass(frozen=True)
class Fact:
    statement: str  # as the user states it
    question: str
    answer: str  # what a retaining answer contains


@dataclass(frozen=True)
class Conversation:
    id: str
    system_prompt: str
    marker: str  # the word the system prompt asks every answer to end with
    turns: tuple[Turn, ...]
    facts: tuple[Fact, ...]  # each asked at the end

    def turn_of(self, fact: Fact) -> int:
        """The index of the turn that states ``fact``."""
        return next(i for i, t in enumerate(self.turns) if retained(t.text, fact))


def _facts(rng: random.Random) -> list[Fact]:
    animal, pet, city = rng.choice(ANIMALS), rng.choice(PETS), rng.choice(CITIES)
    number, colour, dish = str(rng.randint(1000, 9999)), rng.choice(COLOURS), rng.choice(DISHES)
    name = rng.choice(NAMES)
    return [
        Fact(f"My name is {name}.", "What is my name?", name),
        Fact(f"I have a {animal} called {pet}.", f"What is my {animal} called?", pet),
        Fact(f"I live in {city}.", "Which city do I live in?", city),
        Fact(f"My locker code is {number}.", "What is my locker code?", number),
        Fact(f"My favourite colour is {colour}.", "What is my favourite colour?", colour),
        Fact(f"My favourite dish is {dish}.", "What is my favourite dish?", dish),
    ]


def conversation(index: int, seed: int, filler_rounds: int = 10, asked: int = 2) -> Conversation:
    """The ``index``-th conversation of ``seed``: the same every time."""
    rng = random.Random(f"{seed}-{index}")
    facts = rng.sample(_facts(rng), 3)
    marker = rng.choice(MARKERS)
    system = (
        "You are a friendly assistant. Remember what the user tells you about themselves. "
        f"End every answer with the word {marker}."
    )
    turns = [
        Turn(Role.USER, "Hi! " + " ".join(f.statement for f in facts[:2])),
        Turn(Role.ASSISTANT, f"Hello! Thanks for telling me. I will remember that. {marker}"),
        Turn(Role.USER, f"Also, {facts[2].statement[0].lower()}{facts[2].statement[1:]}"),
        Turn(Role.ASSISTANT, f"Got it, I have noted that too. {marker}"),
    ]
    for question, answer in rng.sample(FILLER, filler_rounds):
        turns += [Turn(Role.USER, question), Turn(Role.ASSISTANT, f"{answer} {marker}")]
    return Conversation(f"c{seed}-{index}", system, marker, tuple(turns),
                        tuple(rng.sample(facts, asked)))  # fmt: skip


def conversations(count: int, seed: int, filler_rounds: int = 10) -> list[Conversation]:
    return [conversation(i, seed, filler_rounds) for i in range(count)]


def normalize(text: str) -> str:
    """Lower case, accents and punctuation gone, whitespace single."""
    decomposed = unicodedata.normalize("NFKD", text)
    plain = "".join(c for c in decomposed if not unicodedata.combining(c)).lower()
    return " ".join(re.sub(r"[^\w\s]", " ", plain).split())


def retained(answer: str, fact: Fact) -> bool:
    """The answer states the fact (its value, as a whole word or number)."""
    return f" {normalize(fact.answer)} " in f" {normalize(answer)} "


def obeyed(answer: str, marker: str) -> bool:
    """The system prompt's instruction still holds: the answer has its marker word."""
    return f" {normalize(marker)} " in f" {normalize(answer)} "


_ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(answer: str, reference: str) -> float:
    """ROUGE-L F-measure of ``answer`` against ``reference`` (rouge-score)."""
    return float(_ROUGE.score(reference, answer)["rougeL"].fmeasure)


def bleu4(answer: str, reference: str) -> float:
    """Sentence BLEU-4 (sacrebleu, exponential smoothing), on 0-1."""
    if not reference.strip():
        return 1.0 if not answer.strip() else 0.0
    return float(sacrebleu.sentence_bleu(answer, [reference]).score) / 100.0
