"""Simple English short stories from a small grammar, deterministic from a seed.

The shipped teaching model is trained on these. A story has three short
paragraphs: who the hero is (name, kind, home, a favourite thing and a
friend), what happens one day (one of several plots) and how it ends. The
hero's name, pronouns, thing and friend are fixed per story, so a model must
learn to carry them through the story (attention over the context) rather
than memorise sentences, and each plot has a clear ending after which the
story stops, so a trained model finishes with EOS on its own.

    python -m tools.model.corpus --stories 5 --seed 0     # print a few
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass

# --- The lexicon -----------------------------------------------------------

GIRL_NAMES = [
    "Lily", "Mia", "Rosa", "Nora", "Ella", "Zoe", "Ruby", "Ivy", "Luna", "Hana",
    "Maya", "Ada", "Kira", "Tess", "Wren", "Nell", "Poppy", "Sara", "Jade", "Anna",
]  # fmt: skip
BOY_NAMES = [
    "Tom", "Max", "Ben", "Leo", "Sam", "Finn", "Omar", "Theo", "Kai", "Jack",
    "Milo", "Noah", "Ravi", "Hugo", "Eli", "Otto", "Pablo", "Jonah", "Ned", "Oscar",
]  # fmt: skip
# Kinds of character; people have their own kinds, animals take either pronoun.
PEOPLE = {"girl": "she", "boy": "he", "princess": "she", "prince": "he"}
ANIMALS = [
    "dog", "cat", "rabbit", "bear", "fox", "mouse", "duck", "owl", "frog", "pig",
    "lion", "turtle", "squirrel", "goat", "bird", "puppy", "kitten", "hedgehog",
    "dragon", "robot",
]  # fmt: skip
SIZES = ["little", "small", "big", "tiny", "young", "old"]
TRAITS = ["kind", "brave", "shy", "clever", "happy", "curious", "gentle", "funny", "busy"]
COLOURS = ["red", "blue", "green", "yellow", "brown", "white", "pink", "orange", "purple"]

# Places: (phrase after "in", name of a spot inside it to look or play in)
HOMES = [
    "a small house by the sea",
    "a little house at the edge of the forest",
    "a big old farm",
    "a quiet village near the hills",
    "a busy town by the river",
    "a tall castle on a hill",
    "a blue house with a round door",
    "a cabin in the snowy mountains",
]  # fmt: skip
ANIMAL_HOMES = ["a cosy hole under a tree", "a warm nest in the park", "a hollow log by the pond"]
# Outdoor places, all of which read well after "in the" and "to the".
OUTDOORS = ["park", "forest", "garden", "meadow", "field", "woods", "valley", "orchard"]
# Where someone may sit or something may lie outdoors.
OUT_SPOTS = [
    "under a big tree", "behind a bush", "by the path", "next to a rock",
    "near the water", "in the tall grass", "on a fallen log",
]  # fmt: skip
SPOTS = [
    "under the bed", "behind the door", "in the garden", "under a big rock",
    "in the tall grass", "next to the pond", "behind the old tree", "in the kitchen",
    "under the table", "by the gate", "in a muddy puddle", "on top of the shelf",
]  # fmt: skip
# Things a character can love, lose, share or fix: (noun, adjectives that fit).
THINGS = [
    ("ball", COLOURS + ["bouncy", "shiny"]),
    ("kite", COLOURS + ["long", "paper"]),
    ("hat", COLOURS + ["soft", "funny", "warm"]),
    ("teddy bear", ["brown", "soft", "old", "fluffy"]),
    ("toy boat", COLOURS + ["wooden", "tiny"]),
    ("book", ["old", "thick", "magic", "picture"]),
    ("drum", COLOURS + ["loud", "tiny"]),
    ("scarf", COLOURS + ["long", "warm", "woolly"]),
    ("shell", ["pink", "white", "shiny", "spotted"]),
    ("lamp", ["little", "golden", "old"]),
    ("wagon", COLOURS + ["wooden", "squeaky"]),
    ("flute", ["silver", "wooden", "little"]),
    ("blanket", COLOURS + ["soft", "warm", "striped"]),
    ("key", ["golden", "silver", "tiny", "old"]),
]  # fmt: skip
ACTIVITIES = [
    ("play in the {out}", "played in the {out}"),
    ("sing songs", "sang songs"),
    ("run up and down the {out}", "ran up and down the {out}"),
    ("read stories", "read stories"),
    ("build towers of sticks", "built towers of sticks"),
    ("look at the stars", "looked at the stars"),
    ("draw pictures", "drew pictures"),
    ("dance in the rain", "danced in the rain"),
    ("pick flowers in the {out}", "picked flowers in the {out}"),
    ("splash in the puddles", "splashed in the puddles"),
]  # fmt: skip
FOODS = ["apples", "cake", "berries", "soup", "cookies", "bread", "carrots", "honey", "pie"]
TOPPINGS = ["berries", "honey", "cream", "cherries", "nuts", "apples"]
HAPPY = ["happy", "glad", "proud", "excited", "thankful"]
SAD = ["sad", "upset", "worried", "lonely"]
SCARED = ["scared", "afraid", "nervous"]
TIMES = [
    "One day", "One sunny morning", "One rainy afternoon", "One cold evening",
    "The next day", "One windy day", "Early one morning", "One summer day",
]  # fmt: skip


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# --- A story's cast ---------------------------------------------------------


@dataclass
class Character:
    """Who a story is about: everything a sentence needs to refer to them."""

    name: str
    kind: str
    pronoun: str  # "he" or "she"
    adj: str  # "little", "brave", ...

    @property
    def his(self) -> str:
        return "his" if self.pronoun == "he" else "her"

    @property
    def him(self) -> str:
        return "him" if self.pronoun == "he" else "her"

    @property
    def a_kind(self) -> str:
        """"a little dog": the kind with its adjective and article."""
        return f"{article(self.adj)} {self.adj} {self.kind}"


def make_character(rng: random.Random, taken: set[str]) -> Character:
    if rng.random() < 0.35:
        kind = rng.choice(list(PEOPLE))
        pronoun = PEOPLE[kind]
    else:
        kind = rng.choice(ANIMALS)
        pronoun = rng.choice(["he", "she"])
    names = GIRL_NAMES if pronoun == "she" else BOY_NAMES
    name = rng.choice([n for n in names if n not in taken])
    taken.add(name)
    return Character(name, kind, pronoun, rng.choice(SIZES + TRAITS))


@dataclass
class Cast:
    """One story's fixed choices, shared by all its sentences."""

    hero: Character
    friend: Character
    thing: str  # "ball"
    thing_adj: str  # "red"
    a_thing: str  # "a red ball"
    home: str
    out: str  # an outdoor place: "park"
    activity: tuple[str, str]
    food: str

    def fill(self, template: str, rng: random.Random) -> str:
        """Substitute the cast into `template`, capitalising each sentence."""
        h, f = self.hero, self.friend
        spots = rng.sample(SPOTS, 2)
        words = {
            "name": h.name, "he": h.pronoun, "his": h.his, "him": h.him,
            "kind": h.kind, "a_kind": h.a_kind, "adj": h.adj,
            "friend": f.name, "fhe": f.pronoun, "fhis": f.his, "fhim": f.him,
            "fkind": f.kind, "a_fkind": f.a_kind,
            "thing": self.thing, "thing_adj": self.thing_adj, "home": self.home,
            "out": self.out, "food": self.food,
            "do": self.activity[0].format(out=self.out),
            "did": self.activity[1].format(out=self.out),
            "happy": rng.choice(HAPPY), "sad": rng.choice(SAD), "scared": rng.choice(SCARED),
            "a_thing": self.a_thing, "out_spot": rng.choice(OUT_SPOTS),
            "spot": spots[0], "spot2": spots[1], "time": rng.choice(TIMES),
            "topping": rng.choice(TOPPINGS),
        }  # fmt: skip
        text = template.format(**words)
        return " ".join(s[0].upper() + s[1:] for s in text.split("|"))


def make_cast(rng: random.Random) -> Cast:
    taken: set[str] = set()
    hero = make_character(rng, taken)
    friend = make_character(rng, taken)
    thing, adjs = rng.choice(THINGS)
    adj = rng.choice(adjs)
    homes = HOMES + ANIMAL_HOMES if hero.kind in ANIMALS else HOMES
    return Cast(
        hero, friend, thing, adj, f"{article(adj)} {adj} {thing}", rng.choice(homes),
        rng.choice(OUTDOORS), rng.choice(ACTIVITIES), rng.choice(FOODS),
    )  # fmt: skip


# --- Paragraphs ---------------------------------------------------------------
# A template is one or more sentences; "|" separates sentences so that each is
# capitalised. Braces name the cast's words (see Cast.fill).

OPENINGS = [
    "once upon a time, there was {a_kind} named {name}.",
    "once upon a time, in {home}, there lived {a_kind} called {name}.",
    "the {adj} {kind} was called {name}.",
    "the {adj} {kind} lived in {home}.|{his} name was {name}.",
    "there was once {a_kind} named {name}.",
    "{name} was {a_kind} who lived in {home}.",
    "in {home}, there lived {a_kind}.|{his} name was {name}.",
    "long ago, there was {a_kind} called {name}.",
]
ABOUT = [
    "{name} lived in {home}.",
    "{he} loved to {do}.",
    "every day, {name} liked to {do}.",
    "{name} had {a_thing} that {he} loved very much.",
    "{his} favourite thing was {a_thing}.",
    "{name} had a good friend called {friend}, who was {a_fkind}.",
    "{his} best friend was {a_fkind} named {friend}.",
    "{name} and {friend} often {did} together.",
    "{he} liked to eat {food} for lunch.",
]


def intro(cast: Cast, rng: random.Random, with_friend: bool) -> list[str]:
    """The first paragraph. The thing is always introduced (every plot uses
    it); the friend too, unless the plot is about meeting them."""
    first = rng.choice(OPENINGS)
    thing = rng.choice([t for t in ABOUT if "{a_thing}" in t])
    friends = [t for t in ABOUT if "{friend}" in t and "{did}" not in t]
    extra = [t for t in ABOUT if "{a_thing}" not in t and "{friend}" not in t]
    if "{home}" in first:
        extra = [t for t in extra if "{home}" not in t]
    middle = [thing] + ([rng.choice(friends)] if with_friend else [])
    middle += rng.sample(extra, rng.randint(0, 1))
    rng.shuffle(middle)
    return [first] + middle


def plot_lost(cast: Cast, rng: random.Random) -> tuple[list[str], list[str]]:
    event = [
        "{time}, {name} could not find {his} {thing}.",
        rng.choice(["{he} looked {spot} and {spot2}, but it was not there.",
                    "{he} looked {spot}.|then {he} looked {spot2}.|it was not there."]),
        rng.choice(["{name} felt very {sad}.", "{name} sat down and began to cry."]),
        "{he} went to ask {friend} for help.",
    ]  # fmt: skip
    end = [
        rng.choice(["{friend} said, \"Do not worry, {name}. We will find it together.\"",
                    "\"I will help you,\" said {friend}."]),
        "they looked all over the {out}.",
        "at last, {friend} found the {thing} {out_spot}.",
        rng.choice(["{name} was so {happy} that {he} gave {friend} a big hug.",
                    "\"Thank you, {friend}!\" said {name}, and {he} smiled."]),
        rng.choice(["from that day on, {name} always kept {his} {thing} safe.",
                    "after that, {name} put {his} {thing} away every night."]),
    ]  # fmt: skip
    return event, end


def plot_storm(cast: Cast, rng: random.Random) -> tuple[list[str], list[str]]:
    event = [
        "{time}, {name} and {friend} went to the {out} to {do}.",
        rng.choice(["suddenly, dark clouds filled the sky.",
                    "soon the sky turned grey and the wind began to blow."]),
        "big drops of rain began to fall.",
        rng.choice(["{name} felt {scared}.", "{friend} was {scared} of the thunder."]),
    ]  # fmt: skip
    end = [
        rng.choice(["\"Let us go home,\" said {name}.", "\"Follow me,\" said {friend}."]),
        "they ran all the way back to {home}.",
        rng.choice(["they were wet, but they were safe.", "they dried off by the warm fire."]),
        rng.choice(["soon the rain stopped and a rainbow came out.",
                    "they ate {food} and waited for the sun to come back."]),
        "{name} was {happy} to have a friend like {friend}.",
    ]  # fmt: skip
    return event, end


def plot_share(cast: Cast, rng: random.Random) -> tuple[list[str], list[str]]:
    event = [
        "{time}, {name} was playing with {his} {thing} in the {out}.",
        "{friend} came by and looked at the {thing}.",
        "\"Can I play with it too?\" asked {friend}.",
        rng.choice(["{name} did not want to share.|{he} held the {thing} close.",
                    "{name} said, \"No, it is mine!\""]),
        "{friend} walked away, feeling {sad}.",
    ]  # fmt: skip
    end = [
        rng.choice(["soon {name} felt {sad} too.", "playing alone was not much fun."]),
        "{he} ran after {friend} and said, \"I am sorry.|let us play together.\"",
        "{friend} smiled, and they played with the {thing} all afternoon.",
        rng.choice(["{name} learned that sharing makes playing more fun.",
                    "it was the best day {name} ever had."]),
    ]  # fmt: skip
    return event, end


def plot_new_friend(cast: Cast, rng: random.Random) -> tuple[list[str], list[str]]:
    event = [
        "{time}, {name} went to the {out} alone.",
        "there {he} saw {a_fkind} sitting {out_spot}.",
        "the {fkind} looked {sad}.",
        "\"What is wrong?\" asked {name}.",
        rng.choice(["\"I am new here, and I have no friends,\" said the {fkind}.",
                    "\"I am lost, and I cannot find my way home,\" said the {fkind}."]),
    ]  # fmt: skip
    end = [
        "\"My name is {name}.|I can be your friend,\" said {name}.",
        "the {fkind} smiled and said, \"My name is {friend}.\"",
        rng.choice(["{name} showed {friend} {his} {thing_adj} {thing}.",
                    "{name} shared some {food} with {friend}."]),
        "they {did} until the sun went down.",
        "from that day on, {name} and {friend} were the best of friends.",
    ]  # fmt: skip
    return event, end


def plot_bake(cast: Cast, rng: random.Random) -> tuple[list[str], list[str]]:
    event = [
        "{time}, {name} wanted to make a surprise for {friend}.",
        "{he} decided to bake a cake with {topping} on top.",
        "{he} mixed the flour, the milk and the eggs in a big bowl.",
        rng.choice(["but the oven was too hot, and the cake came out black.",
                    "but {he} dropped the bowl, and the mix went all over the floor."]),
        "{name} felt {sad}.",
    ]  # fmt: skip
    end = [
        "{he} did not give up.",
        "{he} tried again, slowly and carefully.",
        "this time the cake was soft and sweet.",
        "{name} took the cake to {friend}, and they ate it together.",
        rng.choice(["\"This is the best cake ever!\" said {friend}.",
                    "{friend} was so {happy} that {fhe} laughed and laughed."]),
    ]  # fmt: skip
    return event, end


def plot_climb(cast: Cast, rng: random.Random) -> tuple[list[str], list[str]]:
    event = [
        "{time}, {name} was playing with {his} {thing} in the {out}.",
        "{he} threw it up high, and it got stuck on a branch of a tall tree.",
        rng.choice(["{name} tried to jump, but {he} could not reach it.",
                    "{name} was too small to reach it."]),
        "{he} felt {sad}.",
    ]  # fmt: skip
    end = [
        "just then, {friend} came by.",
        rng.choice(["{friend} had a long ladder.", "{friend} was very good at climbing."]),
        "{fhe} climbed up and brought the {thing} down.",
        "\"Thank you, {friend}!\" said {name}.",
        rng.choice(["the two friends {did} until dinner time.",
                    "{name} was {happy}, and {he} never forgot how {friend} helped."]),
    ]  # fmt: skip
    return event, end


def plot_race(cast: Cast, rng: random.Random) -> tuple[list[str], list[str]]:
    event = [
        "{time}, there was a big race in the {out}.",
        "{name} and {friend} both wanted to win.",
        "they ran as fast as they could.",
        rng.choice(["but {friend} fell and hurt {fhis} leg.",
                    "but {friend} tripped over a rock and fell down."]),
    ]  # fmt: skip
    end = [
        "{name} stopped running.",
        "{he} helped {friend} get up.",
        "they walked to the end of the race together.",
        "they did not win, but everyone cheered for them.",
        rng.choice(["{name} felt {happy}, because helping a friend is better than winning.",
                    "{friend} said, \"You are a true friend, {name}.\""]),
    ]  # fmt: skip
    return event, end


PLOTS: list[Callable[[Cast, random.Random], tuple[list[str], list[str]]]] = [
    plot_lost, plot_storm, plot_share, plot_new_friend, plot_bake, plot_climb, plot_race,
]  # fmt: skip


def make_story(rng: random.Random) -> str:
    """One story: three paragraphs separated by blank lines, no end marker."""
    cast = make_cast(rng)
    plot = rng.choice(PLOTS)
    event, end = plot(cast, rng)
    paragraphs = [intro(cast, rng, with_friend=plot is not plot_new_friend), event, end]
    return "\n\n".join(
        " ".join(cast.fill(sentence, rng) for sentence in p) for p in paragraphs
    )


def generate_stories(num_stories: int, seed: int) -> list[str]:
    """`num_stories` stories; the same seed always gives the same stories."""
    rng = random.Random(seed)
    return [make_story(rng) for _ in range(num_stories)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stories", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for story in generate_stories(args.stories, args.seed):
        print(story, end="\n\n</s>\n\n")


if __name__ == "__main__":
    main()
