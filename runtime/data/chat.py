"""The tokenizer and chat templates: a document is (token ids, trained flags); a chat record trains only its
assistant turns, found through the template's {% generation %} blocks or in the rendered text (see runtime.data)."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.data.formats import BadRecord, DataError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_tokenizer(path: str | Path):
    """A local tokenizer folder -> transformers tokenizer (never downloads)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise DataError(f"tokenizer folder {path} does not exist; set data.tokenizer (or model.path) to a "
                        "local folder with tokenizer.json and tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# ---------------------------------------------------------------------------------------------
# Tokenizing: a document is (token ids, trained flags); a trained token is a prediction target.

def tokenize_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, verbose=False)["input_ids"]  # long texts are fine: packing cuts them
    return [x if x and x[-1] == eos else x + [eos] for x in ids]


def _not_verbatim(i: int) -> BadRecord:
    return BadRecord(f"messages[{i}]: the chat template does not render this content verbatim, so its "
                     "tokens cannot be located; use a chat template with {% generation %} markers")


def _end_marker(tokenizer, messages: list[dict]) -> str:
    """What the template writes after the last assistant content ('<|im_end|>' in ChatML), sans whitespace."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    content = messages[-1]["content"]
    at = rendered.rfind(content)
    if at < 0:
        raise _not_verbatim(len(messages) - 1)
    return rendered[at + len(content):].rstrip()


def _assistant_char_spans(tokenizer, messages: list[dict], rendered: str) -> list[tuple[int, int]]:
    """Character spans of assistant content + end marker, for templates without {% generation %}.

    Contents are found in message order (so an assistant reply that repeats the user's words is
    found in its own turn); the end marker comes from rendering the conversation up to that turn.
    This also works for templates that rewrite earlier turns (Qwen3 drops old <think> blocks), where
    rendering prefixes would not give prefixes of the whole conversation.
    """
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        start = rendered.find(message["content"], cursor)
        if start < 0:
            raise _not_verbatim(i)
        cursor = start + len(message["content"])
        if message["role"] == "assistant":
            marker = _end_marker(tokenizer, messages[: i + 1])
            if marker and rendered.startswith(marker, cursor):
                cursor += len(marker)
            spans.append((start, cursor))
    return spans


def tokenize_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Chat-template tokens and, per token, whether it belongs to an assistant turn."""
    if _GENERATION_TAG.search(tokenizer.get_chat_template()):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = _assistant_char_spans(tokenizer, messages, rendered)
    # The same call apply_chat_template(tokenize=True) makes, plus the offsets to map spans to tokens.
    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    trained = [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), trained


def check_tokenizer(tokenizer, kinds: set[str], path: Path) -> None:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; set eos_token in its tokenizer_config.json")
    if "chat" in kinds:
        try:
            tokenizer.get_chat_template()
        except ValueError:
            raise DataError(f"{path} has chat records but the tokenizer has no chat template; use a tokenizer "
                            "folder with chat_template.jinja, or set data.kind: text") from None
