"""The built-in chat prompts a drafter is self-distilled on (topics x request styles).

A head learns the target's answers to these, so variety matters more than count: a
head trained on a few templates agrees with the target on held-out topics of the same
templates (~0.34) but much less on other questions (~0.1-0.3). The styles therefore
range over explanations, lists, how-tos, letters, plans, comparisons, stories and
code. Topics that the bench's chat suite asks about are left out, so its rows measure
prompts the head has not seen.
"""

from __future__ import annotations

import random

# fmt: off
TOPICS = [
    # science and nature
    "photosynthesis", "black holes", "the water cycle", "the immune system", "volcanoes",
    "earthquakes", "plate tectonics", "the solar system", "dinosaurs", "the theory of evolution",
    "the ocean", "rain forests", "the periodic table", "the human heart", "the brain",
    "rainbows", "honey bees", "penguins", "mountains", "electricity", "magnets", "gravity",
    "the speed of light", "DNA", "viruses and bacteria", "coral reefs", "deserts", "glaciers",
    "hurricanes", "tides", "the seasons", "migrating birds", "octopuses", "mushrooms",
    "the human skeleton", "sound waves", "nuclear power", "the greenhouse effect", "comets",
    "the Moon", "Mars", "stars and how they are born", "atoms", "chemical reactions",
    "the nervous system", "digestion", "sleep", "dreams", "wolves", "elephants", "whales",
    "ants", "trees in autumn", "soil", "clouds", "lightning", "snowflakes", "fossils",
    # history and society
    "the French Revolution", "the Roman Empire", "ancient Egypt", "the Renaissance",
    "World War II", "the printing press", "the Apollo missions", "the Great Wall of China",
    "the Industrial Revolution", "the Silk Road", "the Vikings", "ancient Greece",
    "the invention of the telephone", "the history of money", "the Cold War",
    "the Aztec empire", "medieval castles", "the history of writing", "democracy",
    "human rights", "the United Nations", "elections", "taxes", "the Olympic Games",
    "the history of the bicycle", "the first computers", "trains in the 19th century",
    "the invention of paper", "pirates", "the Age of Exploration", "libraries",
    # everyday life and health
    "healthy eating", "running a marathon", "meditation", "public speaking",
    "time management", "friendship", "learning a new language", "gardening", "coffee",
    "tea", "budgeting", "saving for retirement", "moving to a new city", "keeping a journal",
    "houseplants", "adopting a dog", "caring for a cat", "first aid", "drinking enough water",
    "stretching", "walking every day", "cooking rice", "making soup", "packing for a trip",
    "camping", "cleaning a kitchen", "recycling", "composting", "reducing stress",
    "making new friends as an adult", "being a good listener", "writing a thank-you note",
    "planning a birthday party", "learning to swim", "riding a bicycle in the city",
    "cooking for one person", "reading more books", "waking up early", "negotiating a salary",
    "working from home", "starting a small business", "volunteering", "raising chickens",
    "choosing a laptop", "buying a used car", "renting a first apartment", "teaching kids to save",
    # technology and programming
    "machine learning", "the internet", "cybersecurity", "databases", "cloud computing",
    "Python lists", "Python dictionaries", "recursion", "version control with git",
    "unit testing", "regular expressions", "binary numbers", "encryption", "passwords",
    "open source software", "web browsers", "email", "smartphones", "GPS", "electric cars",
    "solar panels", "batteries", "3D printing", "robots", "video games", "search engines",
    "sorting algorithms", "hash tables", "the command line", "APIs", "JSON", "spreadsheets",
    "code reviews", "technical debt", "debugging", "linked lists", "SQL joins",
    "functional programming", "object-oriented programming", "compilers", "operating systems",
    "Wi-Fi", "computer memory", "pixels and screens", "artificial intelligence",
    # arts, culture, economy
    "music theory", "chess", "Shakespeare", "poetry", "jazz", "the piano", "photography",
    "painting with watercolours", "film making", "architecture", "museums", "comic books",
    "folk tales",
    "the stock market", "inflation", "compound interest", "supply and demand", "banks",
    "credit cards", "insurance", "social media", "advertising", "newspapers", "podcasts",
    "board games", "football", "tennis", "yoga", "rock climbing", "sailing", "knitting",
    "pottery", "origami", "calligraphy", "opera", "ballet", "the guitar", "crossword puzzles",
]

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What are three interesting facts about {t}?",
    "Write a short paragraph about {t}.",
    "Why is {t} important?",
    "Give me some tips related to {t}.",
    "Describe the history of {t} briefly.",
    "What is {t}? Answer in two sentences.",
    "Write a short story that involves {t}.",
    "What are the pros and cons of {t}?",
    "How would you teach a child about {t}?",
    "List five questions people often ask about {t}, and answer one of them.",
    "What do most people get wrong about {t}?",
    "Write a short poem about {t}.",
    "Summarize what a beginner should know about {t}.",
    "Give a step-by-step guide to getting started with {t}.",
    "Write a friendly email to a friend telling them what you learned about {t}.",
    "Compare {t} today with fifty years ago.",
    "What are the main ideas behind {t}? Use a bulleted list.",
    "I have ten minutes. Tell me the most useful things about {t}.",
    "Write a short dialogue between a teacher and a student about {t}.",
    "What careers or jobs involve {t}?",
    "Explain {t} to someone who is an expert in cooking but knows nothing else about it.",
    "Give me an analogy that makes {t} easy to understand.",
    "What are common mistakes to avoid with {t}?",
    "Write a blog post introduction about {t}.",
    "How does {t} affect everyday life?",
    "Plan a one-week study schedule for learning about {t}.",
    "Answer like a helpful assistant: can you tell me about {t}?",
    "Write three quiz questions about {t}, with answers.",
    "What might {t} look like in the future?",
]
# fmt: on

HELD_OUT_EVERY = 8  # every 8th topic is never trained on: acceptance is measured there
HELD_OUT_TOPICS = TOPICS[HELD_OUT_EVERY - 1 :: HELD_OUT_EVERY]
TRAINING_PROMPTS = (len(TOPICS) - len(HELD_OUT_TOPICS)) * len(TEMPLATES)
# How many a `train-drafter` run answers unless told: ~50 min of batched generation on a
# 2-core CPU (measured: 900 prompts in 38 min).
DEFAULT_PROMPTS = 1200


def chat_prompts(held_out: bool = False) -> list[str]:
    """Every topic in every style, shuffled (fixed seed), either the training topics or
    the held-out ones; callers take a prefix, so a small run still spans many topics."""
    topics = [t for t in TOPICS if (t in HELD_OUT_TOPICS) == held_out]
    prompts = [template.format(t=topic) for topic in topics for template in TEMPLATES]
    random.Random(0).shuffle(prompts)
    return prompts
