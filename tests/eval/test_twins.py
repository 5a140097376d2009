import gzip
import json

import pytest

from refusion.eval.twins import TwinIndex, normalize, read_queries, shingles, without_twins

TRAIN = [
    "Answer the following question. Question: Students watched a bird fly to and from a large bush every few "
    "minutes. The students told their teacher, \"The bird has a nest in that bush.\" This statement is an example "
    "of what? A) a fact B) an opinion",
    "You are an expert Python programmer, and here is your task: Write a function to find the perimeter of a "
    "rombus. Your code should pass these tests: assert rombus_perimeter(10)==40",
]


def test_normalize_and_shingles():
    assert normalize("  Hello, World!! 2+2 ") == "hello world 2 2"
    assert shingles("a b c", size=6) == {("a", "b", "c")}
    assert len(shingles("one two three four five six seven", size=6)) == 2
    assert shingles("?!") == set()


def test_a_test_question_inside_a_training_prompt_is_a_twin():
    index = TwinIndex(TRAIN)
    question = ("Students watched a bird fly to and from a large bush every few minutes. The students told their "
                "teacher, 'The bird has a nest in that bush.'")
    assert index.find(question) == TRAIN[0]


def test_one_word_changed_in_a_short_task_is_a_twin_but_a_stock_opening_is_not():
    index = TwinIndex(TRAIN)
    assert index.find("Write a function to find the perimeter of a square.") == TRAIN[1]
    assert index.find("Write a function to find the longest common subsequence of two strings.") is None
    assert index.find("") is None


def test_without_twins_splits_items_and_read_queries_reads_gzip(tmp_path):
    path = tmp_path / "answers.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for text in TRAIN:
            f.write(json.dumps({"query": text, "response": "..."}) + "\n")
    index = TwinIndex(read_queries([path]))
    items = [{"id": 1, "text": "Write a function to find the perimeter of a pentagon."},
             {"id": 2, "text": "Write a function that reverses the words of a sentence in place."}]
    kept, dropped = without_twins(items, lambda item: item["text"], index)
    assert [i["id"] for i in kept] == [2] and [i["id"] for i in dropped] == [1]


def test_read_queries_names_a_row_without_the_field(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="record 1 has no 'query' field"):
        read_queries([path])


def test_shared_instructions_do_not_make_twins_but_a_shared_question_does():
    instruction = "Answer the following multiple choice question. Think step by step, then finish with the letter."
    topics = ["volcanoes erupt", "plants need light", "ice floats on water", "magnets attract iron",
              "the moon has phases", "sound needs a medium", "rain forms in clouds", "bees pollinate flowers"]
    training = [f"{instruction} Question: Which statement best explains why {t} in nature, number {i}?"
                for i in range(4) for t in topics]  # 32 texts: the instruction's shingles are common
    index = TwinIndex(training)
    new = f"{instruction} Question: How far does a bicycle travel in ten seconds at two metres a second?"
    assert index.find(new) is None
    assert index.find(training[5].replace(instruction, "Think it through, then answer:")) == training[5]


def test_a_question_asked_again_with_other_options_is_a_twin():
    index = TwinIndex(["Question: Which activity is an example of a good health habit at home?\n\n"
                       "A. watching television\nB. smoking cigarettes\nC. eating candy\nD. exercising every day"])
    again = ("Answer the question.\n\nQuestion: Which activity is an example of a good health habit at home?\n\n"
             "A. riding without a helmet\nB. smoking cigarettes\nC. wearing a hat\nD. eating with dirty hands")
    assert index.find(again) is not None
    assert index.find(again.replace("good health habit at home", "renewable energy source in a city")) is None
