"""Open-ended requests: explanations, stories, how-tos, lists, rewrites and summaries, where an answer has little
to copy from its prompt (unlike GSM8K, ARC or MBPP answers, which reuse the question's words and their own stock
phrases).

The set is composed here, deterministically: request templates of five kinds crossed with topics written for the
project, plus rewrites and summaries of GSM8K train questions (the data folder's texts; never a test split). A
fixed shuffle then puts every fifth request in the held-out part: `open_ended_prompts("test")` is for measuring
(benchmarks, the exact mode's speed where nothing can be copied) and is never used to choose a setting or to
train; `open_ended_prompts("train")` is what a drafter may be distilled and trained on (`refusion generate
--input open-ended`). `open_ended_prompts("extra")` (`--input open-ended-extra`) adds 920 requests for training
only: the same templates over topics the set does not use, and rewrites of the next GSM8K train questions.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

EXPLAIN = ("Explain {} to a ten-year-old.", "What is {}? Answer in a short paragraph.",
           "Why does {} matter? Give three reasons.", "Describe how {} works, step by step.",
           "Write a short encyclopedia entry about {}.")
CONCEPTS = ("photosynthesis", "the water cycle", "gravity", "inflation", "a vaccine", "the internet", "a volcano",
            "compound interest", "recycling", "the immune system", "a black hole", "democracy", "electricity",
            "an earthquake", "the stock market", "climate change", "sleep", "memory", "a rainbow", "the tides",
            "bread dough rising", "a solar panel", "the phases of the moon", "a battery", "friction", "evolution",
            "the printing press", "coffee brewing", "email", "supply and demand")

STORY = ("Write a short story about {}.", "Write a short poem about {}.", "Describe {} in a vivid paragraph.",
         "Write a diary entry from the point of view of {}.")
SUBJECTS = ("a lighthouse keeper", "a lost kitten", "a robot learning to paint", "an old oak tree",
            "a rainy day in the city", "a dragon who is afraid of heights", "a child's first day at school",
            "a fishing village at dawn", "a time traveller", "a busy train station", "a snowman",
            "a forgotten library", "a street musician", "a sailor in a storm", "a garden in spring",
            "a mountain climber", "an astronaut", "a baker at midnight", "a small town festival", "a talking parrot")

HOW_TO = ("How do I {}? Give clear steps.", "Give me five tips to {}.",
          "What mistakes do people often make when they try to {}?", "Write a checklist for someone who wants to {}.")
ACTIVITIES = ("grow tomatoes on a balcony", "learn to swim", "save money every month", "prepare for a job interview",
              "start running", "make a good cup of tea", "organize a small birthday party", "learn a new language",
              "keep a houseplant alive", "write a polite email", "study for an exam", "cook rice",
              "clean a bicycle chain", "train a puppy", "pack for a weekend trip", "improve my handwriting",
              "spend less time on my phone", "start a vegetable garden", "make friends in a new city", "bake bread")

EXTRA_CONCEPTS = ("a rain forest", "the human heart", "a lunar eclipse", "magnetism", "a hurricane", "vitamins",
                  "the speed of sound", "a refrigerator", "coral reefs", "the Roman Empire", "an airplane wing",
                  "photosynthesis in algae", "a thermometer", "the seasons", "a glacier", "bees and pollination",
                  "a microscope", "interest rates", "a library catalogue", "the postal system", "a lighthouse lens",
                  "a suspension bridge", "fermentation", "a compass", "desert animals", "the nervous system",
                  "a wind turbine", "tree rings", "a credit score", "composting", "a telescope", "sound waves",
                  "the food chain", "a budget", "an election", "soap", "a camera", "ocean currents", "a fever",
                  "the alphabet", "a calendar", "a hydroelectric dam", "dinosaur fossils", "a password", "rust",
                  "a map projection", "a bicycle gear", "the water table", "a spreadsheet", "migration of birds",
                  "a vaccine trial", "a market price", "an orchestra", "a clock", "a virus", "erosion",
                  "a search engine", "a recipe", "the Olympic Games", "a museum")
"""Topics of the extra requests (`open_ended_prompts("extra")`), none of them in CONCEPTS."""

EXTRA_SUBJECTS = ("a clockmaker's apprentice", "a lost umbrella", "a girl who collects stones", "an old ferry",
                  "a night at the observatory", "a fox in the snow", "a tired delivery driver", "a village well",
                  "a kite that will not fly", "a retired pilot", "a rainy market", "a robot gardener",
                  "a tiny island", "a brave turtle", "a school play", "a night train", "a broken piano",
                  "a grandmother's recipe book", "a summer storm", "a shy giant", "a city at dawn",
                  "a young beekeeper", "a forgotten toy", "a mountain hut", "a lighthouse cat", "a desert caravan",
                  "a chess tournament", "a paper boat", "a firefighter's first day", "a friendly ghost",
                  "an autumn fair", "a marathon runner", "a space station cook", "a river otter", "a lost letter",
                  "a carpenter's workshop", "a foggy harbour", "a snowy bus stop", "a sleepy owl", "a new neighbour")
"""Subjects of the extra stories, none of them in SUBJECTS."""

EXTRA_ACTIVITIES = ("plan a picnic", "repair a flat tire", "write a short speech", "start journaling",
                    "organize a bookshelf", "learn to juggle", "sleep better", "make a simple budget",
                    "care for a goldfish", "prepare a family dinner", "learn to draw faces", "paint a room",
                    "start a book club", "get up earlier", "learn basic first aid", "plant a tree",
                    "make homemade soup", "teach a child to ride a bike", "declutter a closet", "learn to knit",
                    "write a thank-you note", "prepare for a long flight", "take better photos",
                    "reduce food waste", "learn chess", "run a yard sale", "build a birdhouse",
                    "set up a home office", "make pancakes", "practice a musical instrument",
                    "give a good presentation", "choose a used car", "keep a diary in a new language",
                    "host a board game night", "save energy at home", "walk a dog safely", "make a smoothie",
                    "memorize a poem", "fix a squeaky door", "start meditating")
"""Activities of the extra how-tos, none of them in ACTIVITIES."""

REWRITE = ("Summarize the following text in one sentence.\n\n{}", "Rewrite the following text in simpler words.\n\n{}",
           "Turn the following text into a short story.\n\n{}")
REWRITTEN_TEXTS = 40
"""GSM8K train questions rewritten or summarized (the first ones of the file)."""
EXTRA_REWRITTEN_TEXTS = 100
"""GSM8K train questions the extra requests rewrite or summarize: the next ones after REWRITTEN_TEXTS."""
HELD_OUT_EVERY = 5
"""Every fifth request of the shuffled set is held out."""
SEED = 0
"""The fixed shuffle's seed: the set and its split are the same on every machine."""
SPLITS = {"open-ended": "train", "open-ended-test": "test", "open-ended-extra": "extra"}
"""The `generate --input` names of the two parts and of the extra requests."""


def _compose(concepts, subjects, activities, texts: slice, data_dir: str | Path | None) -> list[tuple[str, str]]:
    """(kind, request) of the templates over these topics, then rewrites of the GSM8K train questions `texts`
    (a slice of the file's lines), in composition order."""
    from refusion.data import builtin_train_file

    requests = [("explain", t.format(c)) for t, c in itertools.product(EXPLAIN, concepts)]
    requests += [("story", t.format(s)) for t, s in itertools.product(STORY, subjects)]
    requests += [("how-to", t.format(a)) for t, a in itertools.product(HOW_TO, activities)]
    with open(builtin_train_file("gsm8k", data_dir), encoding="utf-8") as f:
        lines = itertools.islice(f, texts.start, texts.stop)
        questions = [json.loads(line)["question"].strip() for line in lines]
    requests += [("rewrite", t.format(text)) for t, text in itertools.product(REWRITE, questions)]
    return requests


def _requests(data_dir: str | Path | None) -> list[tuple[str, str]]:
    """(kind, request) of the whole set, in composition order."""
    return _compose(CONCEPTS, SUBJECTS, ACTIVITIES, slice(0, REWRITTEN_TEXTS), data_dir)


def _extra_requests(data_dir: str | Path | None) -> list[tuple[str, str]]:
    """(kind, request) of the extra requests: the same templates over topics the set does not use, and rewrites
    of the next GSM8K train questions."""
    return _compose(EXTRA_CONCEPTS, EXTRA_SUBJECTS, EXTRA_ACTIVITIES,
                    slice(REWRITTEN_TEXTS, REWRITTEN_TEXTS + EXTRA_REWRITTEN_TEXTS), data_dir)


def _fixed_order(n: int) -> list[int]:
    """0..n-1 in the fixed shuffle (SEED): the same on every machine."""
    order = list(range(n))
    random.Random(SEED).shuffle(order)
    return order


def open_ended_prompts(split: str, data_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """(origin, request) of one part of the set, "train" or "test", in a fixed order; the origin is
    "open-ended:<kind>:<index in the whole set>". "extra": more requests for training only, on topics and texts
    the set does not use (so the test part stays apart), shuffled so that a prefix mixes the kinds; origin
    "open-ended-extra:<kind>:<index>"."""
    if split == "extra":
        requests = _extra_requests(data_dir)
        return [(f"open-ended-extra:{requests[i][0]}:{i}", requests[i][1]) for i in _fixed_order(len(requests))]
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} is invalid: must be 'train', 'test' or 'extra'")
    requests = _requests(data_dir)
    order = _fixed_order(len(requests))
    chosen = [i for rank, i in enumerate(order) if (rank % HELD_OUT_EVERY == 0) == (split == "test")]
    return [(f"open-ended:{requests[i][0]}:{i}", requests[i][1]) for i in chosen]
