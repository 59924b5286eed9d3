"""Regenerate the tiny example's dataset and tokenizer, offline and deterministically.

    python examples/tiny/build_assets.py [OUT_DIR]

writes, next to this file (or under OUT_DIR):
    data/train.jsonl   chat records ({"messages": [...]}) : arithmetic, counting, facts, echo
    data/text.jsonl    plain-text records ({"text": ...})  : templated stories, counting, arithmetic
    tokenizer/         a byte-level BPE (Qwen-style pre-tokenizer: single digits) trained on both
                       files, with Qwen's special tokens and a ChatML chat template whose assistant
                       turns sit in {% generation %} blocks (so return_assistant_tokens_mask works)

The data is templated so that a tiny model's loss falls visibly within a few dozen steps. The
generated files are committed; rerun this only to change them (the output is byte-identical for
the same code).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 512
NUM_CHAT, NUM_TEXT = 3000, 2000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2/3's pre-tokenizer split: digits one by one, letters with at most one leading symbol.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatML as Qwen writes it; the assistant's content and its <|im_end|> are the trained tokens.
CHAT_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}
            {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

COLORS = {"sky": "blue", "grass": "green", "banana": "yellow", "snow": "white", "coal": "black",
          "tomato": "red", "orange": "orange", "plum": "purple", "sea": "blue", "leaf": "green"}
ANIMALS = ["cat", "dog", "bird", "fox", "cow", "frog", "duck", "goat"]
PLACES = ["mat", "hill", "box", "log", "rug", "bed", "wall", "road"]
NAMES = ["Anna", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana"]
PHRASES = ["good morning", "the sun is warm", "we like green tea", "a cat can jump",
           "rain falls down", "open the door", "read the book", "the moon is round"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
SYSTEM = "You are a helpful assistant."


def chat_turn(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) pair from a small set of templates with exact answers."""
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(20), rng.randrange(20)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        a = rng.randrange(30)
        n = rng.randrange(3, 8)
        return f"Count from {a} to {a + n}.", " ".join(str(i) for i in range(a, a + n + 1))
    if kind == 2:
        thing = rng.choice(sorted(COLORS))
        return f"What color is the {thing}?", f"The {thing} is {COLORS[thing]}."
    if kind == 3:
        phrase = rng.choice(PHRASES)
        return f"Repeat after me: {phrase}", phrase
    word = rng.choice(ANIMALS)
    return f"Spell the word {word}.", "-".join(word)


def chat_record(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    for _ in range(1 if rng.random() < 0.7 else 2):
        question, answer = chat_turn(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def text_record(rng: random.Random) -> dict:
    kind = rng.randrange(3)
    if kind == 0:
        name, animal, place = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES)
        text = (f"{name} has a {animal}. The {animal} sat on the {place}. "
                f"{name} said: good {animal}, stay on the {place}.")
    elif kind == 1:
        start = rng.randrange(6)
        text = "We count: " + ", ".join(NUMBER_WORDS[start:start + 5]) + "."
    else:
        name, n = rng.choice(NAMES), rng.randrange(2, 10)
        text = f"{name} has {n} apples. {name} eats one apple. Now {name} has {n - 1} apples."
    return {"text": text}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def corpus(chat: list[dict], text: list[dict]):
    """Training text for the BPE: what the chat template renders plus the plain texts."""
    for record in chat:
        for m in record["messages"]:
            yield f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    for record in text:
        yield record["text"]


def build_tokenizer(chat: list[dict], text: list[dict]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(chat, text), trainer=trainer)
    # Qwen's convention: <|endoftext|> is bos/pad, <|im_end|> ends a turn and is the eos.
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
                                   model_max_length=4096)


def main(out: Path = HERE) -> None:
    rng = random.Random(0)
    chat = [chat_record(rng) for _ in range(NUM_CHAT)]
    text = [text_record(rng) for _ in range(NUM_TEXT)]
    write_jsonl(out / "data" / "train.jsonl", chat)
    write_jsonl(out / "data" / "text.jsonl", text)
    build_tokenizer(chat, text).save_pretrained(out / "tokenizer")
    print(f"wrote {out / 'data'} ({NUM_CHAT} chat, {NUM_TEXT} text records) and {out / 'tokenizer'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
