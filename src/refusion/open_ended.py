"""Open-ended requests: explanations, stories, how-tos, lists, rewrites and summaries, where an answer has little
to copy from its prompt (unlike GSM8K, ARC or MBPP answers, which reuse the question's words and their own stock
phrases).

The set is composed here, deterministically: request templates of five kinds crossed with topics written for the
project, plus rewrites and summaries of GSM8K train questions (the data folder's texts; never a test split). A
fixed shuffle then puts every fifth request in the held-out part: `open_ended_prompts("test")` is for measuring
(benchmarks, the exact mode's speed where nothing can be copied) and is never used to choose a setting or to
train; `open_ended_prompts("train")` is what a drafter may be distilled and trained on (`refusion generate
--input open-ended`). `open_ended_prompts("extra")` (`--input open-ended-extra`) adds 920 requests for training
only: the same templates over topics the set does not use, and rewrites of the next GSM8K train questions;
`open_ended_prompts("extra-2")` and `("extra-3")` (`--input open-ended-extra-2`, `open-ended-extra-3`) 1,841 and
1,375 more the same way, each on topics and texts no earlier set uses; `("extra-4")` 9,864 more from new
templates (lists of facts, analogies, quizzes, guides, plans, titles, dialogues...) over the extra sets' topics
and the next GSM8K train questions.
"""

from __future__ import annotations

import itertools
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

EXTRA_2_CONCEPTS = ("a kidney", "the ozone layer", "a tsunami", "a lever", "an atom", "the metric system",
                    "a bank loan", "a sewer system", "blood types", "a rocket engine", "a coral island",
                    "the solar system", "plate tectonics", "a lightning strike", "an allergy", "the stomach",
                    "a greenhouse", "a fire extinguisher", "a jet stream", "a cell phone tower", "an antibiotic",
                    "a tax return", "a wetland", "an ant colony", "a submarine", "a hot air balloon", "insulin",
                    "the Great Wall of China", "a pulley", "a pension", "a salmon run", "a printer",
                    "the equator", "an X-ray", "a loom", "a windmill", "the Milky Way", "a dictionary",
                    "a vending machine", "a traffic light", "a satellite", "a cactus", "a tornado", "the skeleton",
                    "an insurance policy", "a seed bank", "a sundial", "an elevator", "a coral bleaching event",
                    "a glacier lake", "a magnet", "a steam engine", "the heartbeat", "a water filter",
                    "a time zone", "the lungs", "a startup company", "a patent", "a comet",
                    "a barcode", "a refrigerator magnet", "a hearing aid", "a mortgage", "a nuclear reactor",
                    "a kaleidoscope", "a thermostat", "a canal lock", "a spider web", "the Sahara Desert",
                    "the Amazon River", "a monsoon", "a recycling plant", "a dam's spillway", "a pharmacy",
                    "an ecosystem", "a caterpillar's metamorphosis", "a savings account", "a laser",
                    "an encyclopedia", "a fossil fuel", "a geyser", "a quarry", "a beehive", "a mushroom",
                    "a pendulum", "a trade agreement", "an avalanche", "a crossword puzzle", "a jury",
                    "a parliament", "a census", "a newspaper", "a radio", "the human eye", "a bridge's arch",
                    "a weather balloon", "an ice age", "a marathon", "a chess opening", "a symphony",
                    "a sea lion", "a currency exchange", "a shipping container", "a lighthouse beam",
                    "a cloud", "a snowflake", "the Arctic", "penguins", "a coral fish", "a compass needle",
                    "a blood donation", "a hospital", "a fire station", "a public library", "a city park",
                    "a subway line", "a bus timetable", "a grocery store", "a bakery oven", "a washing machine",
                    "a dishwasher", "a vacuum cleaner", "a microwave oven", "a light bulb", "a fuse box",
                    "a smoke detector", "a door lock", "a keyboard", "a computer mouse", "a hard drive",
                    "a web browser", "a text message", "a video call", "a spam filter", "a backup copy",
                    "an online shop", "a delivery route", "a warehouse", "a factory line", "a farm tractor",
                    "crop rotation", "an irrigation canal", "a fishing net", "a sailboat", "a canoe")
"""Topics of the second extra requests (`open_ended_prompts("extra-2")`), in neither CONCEPTS nor EXTRA_CONCEPTS."""

EXTRA_2_SUBJECTS = ("a bridge at midnight", "a curious hedgehog", "an old bookshop", "a nervous pianist",
                    "a travelling circus", "a lonely satellite", "a windy beach", "a garden gnome", "a quiet forest",
                    "a hot summer afternoon", "a mountain goat", "a sleepy cat", "a city bus driver",
                    "a winter morning", "a mountain stream", "a young inventor", "an old tortoise",
                    "a hidden waterfall", "a desert oasis", "a night sky full of stars", "a busy kitchen",
                    "a jazz club", "a little seed", "a painter by the river", "a clock tower",
                    "a family road trip", "a rainy harbour", "a field of sunflowers", "a clumsy wizard",
                    "a castle on a hill")
"""Subjects of the second extra stories and poems, in neither SUBJECTS nor EXTRA_SUBJECTS."""

EXTRA_2_ACTIVITIES = ("wash a car", "set up a fish tank", "make a paper airplane", "learn to type faster",
                      "plan a road trip", "set up a chessboard", "care for a cactus", "start a podcast",
                      "learn to play the guitar", "write a short story", "make a budget for a holiday",
                      "iron a shirt", "sew a button", "clean a kitchen oven", "organize a garage",
                      "change a light bulb", "stay focused while studying", "make a fruit salad",
                      "learn to ice skate", "grow herbs indoors", "groom a horse", "write a resume",
                      "prepare for a marathon", "make a paper lantern", "plan a wedding", "shop for groceries",
                      "make a scrapbook", "fold a fitted sheet", "sharpen a kitchen knife", "start birdwatching",
                      "build a sandcastle", "learn to dance", "make a birthday card", "set goals for the year",
                      "keep a room tidy", "care for a rabbit", "learn to ski", "make lemonade",
                      "write a cover letter", "plan a school project", "fix a leaking tap", "paint a fence",
                      "hang a picture frame", "assemble flat-pack furniture", "learn to sing", "pick a good melon",
                      "store vegetables", "make a cheese sandwich", "prepare a picnic basket", "learn to row",
                      "take care of a sunburn", "choose running shoes", "plan a camping trip", "write a limerick",
                      "tie a tie", "make a campfire safely", "read a map", "clean windows",
                      "learn to read music", "volunteer in my community", "start a compost bin",
                      "make new habits stick", "recover after a long run", "prepare for a storm",
                      "learn to whistle", "make hot chocolate", "repot a plant", "stretch after exercise",
                      "plan a surprise party", "learn to code", "cut my own hair", "wrap a present",
                      "read more books", "clean a laptop keyboard", "make a to-do list", "negotiate a price",
                      "back up my photos", "learn to meditate at work", "cook an omelette", "bake cookies",
                      "grow strawberries", "make a snowman", "fly a kite", "learn to skateboard",
                      "stay warm in winter", "stay cool in summer", "drink more water", "make a podcast episode",
                      "write a letter to a friend", "prepare a science fair project", "care for a hamster",
                      "train for a bike race", "learn photography", "organize my email", "plan meals for a week",
                      "remove a stain from a shirt", "build a snow fort", "learn magic tricks",
                      "make a family tree")
"""Activities of the second extra how-tos, in neither ACTIVITIES nor EXTRA_ACTIVITIES."""

EXTRA_3_CONCEPTS = ("a kangaroo", "the Eiffel Tower", "a pyramid", "a steam locomotive", "a violin", "a piano",
                    "the Internet of Things", "a drone", "an electric car", "a bus network", "a seaport",
                    "an airport", "a lighthouse keeper's job", "a weather forecast", "a thunderstorm", "fog",
                    "hail", "a heat wave", "a drought", "a flood", "a wildfire", "a river delta", "a canyon",
                    "a cave", "stalactites", "a waterfall", "an oasis", "a prairie", "a tundra", "a mangrove",
                    "a kelp forest", "a whale", "an octopus", "a jellyfish", "a shark", "a dolphin", "an eagle",
                    "an owl", "a bat", "a frog", "a snake", "a chameleon", "an elephant", "a giraffe", "a camel",
                    "a polar bear", "a panda", "a honeybee's dance", "an earthworm", "a butterfly", "a dragonfly",
                    "a spider", "a crab", "a seahorse", "a sunflower", "a pine tree", "moss", "algae", "a fern",
                    "a seed", "pollen", "a root system", "a leaf", "bark", "a fruit", "a hedge maze",
                    "a farmer's market", "a vineyard", "an orchard", "cheese making", "yogurt", "chocolate",
                    "a kettle", "spices", "salt", "sugar", "honey", "olive oil", "rice farming", "wheat", "corn",
                    "potatoes", "a bakery", "a restaurant kitchen", "a food truck", "a cookbook", "a menu",
                    "table manners", "a birthday party", "a wedding", "a holiday", "a parade", "a carnival",
                    "a circus", "a theatre", "a cinema", "a novel", "a poem", "a fairy tale", "a myth",
                    "a comic book", "a painting", "a sculpture", "a photograph", "a mural", "pottery", "origami",
                    "a board game", "a video game", "a puzzle", "a sport", "football", "tennis", "rowing",
                    "cycling", "yoga", "a gym", "a team captain", "a referee", "a coach", "a trophy")
"""Topics of the third extra requests (`open_ended_prompts("extra-3")`), in no earlier list."""

EXTRA_3_ACTIVITIES = ("learn to play tennis", "start rock climbing", "build a model airplane", "grow a bonsai tree",
                      "write a haiku", "plan a museum visit", "make a simple website", "learn to yo-yo",
                      "train for a 5k race", "make a paper mache bowl", "clean a fish tank", "learn to surf",
                      "make a kite", "go on a night walk safely", "prepare a lunch box", "make granola",
                      "make a smoothie bowl", "make a sandwich wrap", "decorate cupcakes", "make dumplings",
                      "cook a vegetable soup", "roast vegetables", "make a salad dressing", "repair a zipper",
                      "plan a scavenger hunt", "plan a tea party", "host a dinner party", "set a table",
                      "fold napkins", "write a poem for a friend", "make a greeting card", "knit a scarf",
                      "sew a pillow", "paint with watercolors", "draw a portrait", "take a selfie",
                      "edit a photo", "make a short video", "start a blog", "write a product review",
                      "prepare for a debate", "improve my memory", "learn faster", "take good notes",
                      "manage my time", "stop procrastinating", "stay motivated", "deal with stress",
                      "be more patient", "say no politely", "apologize sincerely", "give feedback kindly",
                      "ask for a raise", "prepare for a first day at work", "work from home", "lead a meeting",
                      "run a team project", "write a business plan", "read a bus timetable", "pay off debt",
                      "compare prices online", "shop for a laptop", "set up a new phone", "protect my privacy online",
                      "create a strong password", "spot a scam email", "clean up my computer",
                      "learn to use a spreadsheet",
                      "plant flowers", "water a garden", "prune a rose bush", "attract birds to a garden",
                      "care for a turtle", "walk a cat on a leash", "bathe a dog", "choose a pet",
                      "teach a parrot to talk", "feed wild birds", "build a bird feeder", "go fishing")
"""Activities of the third extra how-tos, in no earlier list (no stories: most run past the length limit)."""

REWRITE = ("Summarize the following text in one sentence.\n\n{}", "Rewrite the following text in simpler words.\n\n{}",
           "Turn the following text into a short story.\n\n{}")
TEMPLATES = (EXPLAIN, STORY, HOW_TO, REWRITE)
"""The set's request templates by kind: explanations, stories, how-tos, rewrites."""

EXTRA_4_TEMPLATES = (
    ("List five interesting facts about {}.", "What are the main parts of {}? Describe each one briefly.",
     "Explain {} using a simple everyday analogy.", "Write a short paragraph about the history of {}.",
     "What are some common misconceptions about {}?", "Write three quiz questions about {}, with their answers.",
     "In three sentences, explain {} to someone who has never heard of it.",
     "How would you teach a class about {}? Give a short lesson plan.",
     "Write the opening paragraph of a blog post about {}.",
     "What might a curious child ask about {}? Answer two of the questions.",
     "Give a short definition of {} and one example.", "Why is {} important to people today?"),
    (),
    ("What do I need before I {}? Make a short list.", "Write a beginner's guide on how to {}.",
     "Explain the first three steps to {}.", "Why is it worth it to {}?",
     "My friend wants to {}. What advice would you give?", "Give me a simple one-week plan to {}.",
     "What is the easiest way to {}?", "Describe how to {} in one paragraph."),
    REWRITE + ("Explain the following problem in your own words, without solving it.\n\n{}",
               "List the facts given in the following text.\n\n{}", "Write a title for the following text.\n\n{}",
               "Rewrite the following text as a short dialogue.\n\n{}"))
"""The fourth extra set's templates (`open_ended_prompts("extra-4")`), in no earlier set: twelve explanations,
eight how-tos and four more rewrites (with the set's three) per topic or text; no stories (most run past the
length limit)."""
REWRITTEN_TEXTS = 40
"""GSM8K train questions rewritten or summarized (the first ones of the file)."""
HELD_OUT_EVERY = 5
"""Every fifth request of the shuffled set is held out."""
SEED = 0
"""The fixed shuffle's seed: the set and its split are the same on every machine."""
EXTRA_SETS = {"extra": (EXTRA_CONCEPTS, EXTRA_SUBJECTS, EXTRA_ACTIVITIES, 100, TEMPLATES),
              "extra-2": (EXTRA_2_CONCEPTS, EXTRA_2_SUBJECTS, EXTRA_2_ACTIVITIES, 200, TEMPLATES),
              "extra-3": (EXTRA_3_CONCEPTS, (), EXTRA_3_ACTIVITIES, 150, TEMPLATES),
              "extra-4": (EXTRA_CONCEPTS + EXTRA_2_CONCEPTS + EXTRA_3_CONCEPTS, (),
                          EXTRA_ACTIVITIES + EXTRA_2_ACTIVITIES + EXTRA_3_ACTIVITIES, 600, EXTRA_4_TEMPLATES)}
"""The sets of extra requests, for training only: (concepts, subjects, activities, GSM8K train questions to
rewrite: the next ones after the earlier sets', templates by kind). The first three use the set's templates on
topics of their own; the fourth, new templates on the earlier extra sets' topics (never the set's own)."""
SPLITS = {"open-ended": "train", "open-ended-test": "test", **{f"open-ended-{name}": name for name in EXTRA_SETS}}
"""The `generate --input` names of the two parts and of the sets of extra requests."""


def _compose(concepts, subjects, activities, texts: slice, data_dir: str | Path | None,
             templates=TEMPLATES) -> list[tuple[str, str]]:
    """(kind, request) of the templates over these topics, then rewrites of the GSM8K train questions `texts`
    (a slice of the file's lines), in composition order."""
    from refusion.data import builtin_train_file
    from refusion.jsonl import jsonl_records

    explain, story, how_to, rewrite = templates
    requests = [("explain", t.format(c)) for t, c in itertools.product(explain, concepts)]
    requests += [("story", t.format(s)) for t, s in itertools.product(story, subjects)]
    requests += [("how-to", t.format(a)) for t, a in itertools.product(how_to, activities)]
    rows = itertools.islice(jsonl_records(builtin_train_file("gsm8k", data_dir)), texts.start, texts.stop)
    questions = [row["question"].strip() for _, row in rows]
    requests += [("rewrite", t.format(text)) for t, text in itertools.product(rewrite, questions)]
    return requests


def _requests(data_dir: str | Path | None) -> list[tuple[str, str]]:
    """(kind, request) of the whole set, in composition order."""
    return _compose(CONCEPTS, SUBJECTS, ACTIVITIES, slice(0, REWRITTEN_TEXTS), data_dir)


def _extra_requests(name: str, data_dir: str | Path | None) -> list[tuple[str, str]]:
    """(kind, request) of one set of extra requests (EXTRA_SETS): the templates over topics no other set uses,
    and rewrites of the GSM8K train questions after those of the sets before it."""
    first = REWRITTEN_TEXTS
    for other, (concepts, subjects, activities, texts, templates) in EXTRA_SETS.items():
        if other == name:
            return _compose(concepts, subjects, activities, slice(first, first + texts), data_dir, templates)
        first += texts
    raise KeyError(name)


def _fixed_order(n: int) -> list[int]:
    """0..n-1 in the fixed shuffle (SEED): the same on every machine."""
    order = list(range(n))
    random.Random(SEED).shuffle(order)
    return order


def open_ended_prompts(split: str, data_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """(origin, request) of one part of the set, "train" or "test", in a fixed order; the origin is
    "open-ended:<kind>:<index in the whole set>". "extra": more requests for training only, on topics and texts
    the set does not use (so the test part stays apart), shuffled so that a prefix mixes the kinds; origin
    "open-ended-extra:<kind>:<index>". "extra-2", "extra-3", "extra-4": more such sets (`--input open-ended-extra-2`,
    ...), on topics and texts no earlier set uses, or (extra-4) templates no earlier set uses; origin
    "open-ended-extra-2:<kind>:<index>", ..."""
    if split in EXTRA_SETS:
        requests = _extra_requests(split, data_dir)
        return [(f"open-ended-{split}:{requests[i][0]}:{i}", requests[i][1]) for i in _fixed_order(len(requests))]
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} is invalid: must be 'train', 'test' or one of {', '.join(EXTRA_SETS)}")
    requests = _requests(data_dir)
    order = _fixed_order(len(requests))
    chosen = [i for rank, i in enumerate(order) if (rank % HELD_OUT_EVERY == 0) == (split == "test")]
    return [(f"open-ended:{requests[i][0]}:{i}", requests[i][1]) for i in chosen]
