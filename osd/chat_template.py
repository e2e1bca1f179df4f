r"""Chat prompts: conversations formatted with a tokenizer's chat template.

>>> from osd import zoo
>>> from osd.models.loading import load_tokenizer
>>> tok = load_tokenizer(zoo.chat_pair()[0])
>>> ids = apply_chat_template(tok, [[{"role": "user", "content": "Hi!"}]])
>>> tok.decode(ids[0]).endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
True
"""

from __future__ import annotations

from typing import Mapping, Sequence

ROLES = ("system", "user", "assistant", "tool")


def validate_conversations(conversations) -> list[list[dict]]:
    """Check ``conversations`` (a list of conversations, each a non-empty list of
    ``{"role", "content"}`` messages) and return plain copies. TypeError for wrong types
    (including one conversation passed without the outer list), ValueError for an empty
    list, an unknown role or a message without content."""
    if isinstance(conversations, (str, bytes, Mapping)) or not isinstance(conversations, Sequence):
        raise TypeError(
            f"conversations must be a list of conversations (lists of "
            f"{{'role', 'content'}} messages), got {type(conversations).__name__}"
        )
    if not conversations:
        raise ValueError("conversations is empty: give at least one conversation")
    if isinstance(conversations[0], Mapping):
        raise TypeError(
            "conversations must be a list of conversations; for one conversation pass [messages]"
        )
    out = []
    for i, conv in enumerate(conversations):
        if isinstance(conv, (str, bytes, Mapping)) or not isinstance(conv, Sequence):
            raise TypeError(
                f"conversation {i} must be a list of messages, got {type(conv).__name__}"
            )
        if not conv:
            raise ValueError(f"conversation {i} is empty: give at least one message")
        messages = []
        for j, msg in enumerate(conv):
            where = f"conversation {i}, message {j}"
            if not isinstance(msg, Mapping):
                raise TypeError(
                    f"{where} must be a dict with 'role' and 'content', got {type(msg).__name__}"
                )
            if "role" not in msg:
                raise ValueError(f"{where} has no 'role'; expected one of {', '.join(ROLES)}")
            if msg["role"] not in ROLES:
                raise ValueError(
                    f"{where} has role {msg['role']!r}; expected one of {', '.join(ROLES)}"
                )
            if "content" not in msg or msg["content"] is None:
                raise ValueError(f"{where} ({msg['role']}) has no 'content'")
            if not isinstance(msg["content"], str):
                raise TypeError(
                    f"{where} ({msg['role']}): content must be a str, got "
                    f"{type(msg['content']).__name__}"
                )
            messages.append(dict(msg))
        out.append(messages)
    return out


def apply_chat_template(tokenizer, conversations) -> list[list[int]]:
    """Token ids of each conversation formatted with ``tokenizer``'s chat template, ending
    with the generation prompt (the assistant turn's opening), ready to generate from.

    Args:
        tokenizer: a transformers tokenizer with a ``chat_template``.
        conversations: a list of conversations, each a list of ``{"role": ..., "content":
            str}`` messages; roles are ``system``, ``user``, ``assistant`` and ``tool``.

    Returns one list of token ids per conversation. The template writes any BOS itself, so
    the tokenizer adds no special tokens. Raises as :func:`validate_conversations`, and
    ValueError when the tokenizer has no chat template.
    """
    conversations = validate_conversations(conversations)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template; chat needs a model whose "
            "tokenizer ships one (e.g. a GGUF file with tokenizer.chat_template)"
        )
    out = []
    for conv in conversations:
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


# A base model's tokenizer has no chat template; such models are asked in the plain
# question-and-answer transcript their pretraining text is full of.
QUESTION, ANSWER = "Question:", "Answer:"


def plain_transcript(conversation: list[dict]) -> str:
    """One conversation as a plain-text transcript for a model without a chat template:
    system text first, each user turn ``Question: ...``, each assistant turn ``Answer:
    ...``, ending with ``Answer:`` for the model to continue (tool messages are shown as
    ``Tool: ...``)."""
    parts = []
    for m in conversation:
        text = m["content"].strip()
        if m["role"] == "system":
            parts.append(text + "\n\n")
        elif m["role"] == "user":
            parts.append(f"{QUESTION} {text}\n")
        elif m["role"] == "assistant":
            parts.append(f"{ANSWER} {text}\n\n")
        else:
            parts.append(f"Tool: {text}\n")
    return "".join(parts) + ANSWER


def encode_chat(tokenizer, conversations) -> list[list[int]]:
    """Token ids of ``conversations``: the tokenizer's chat template
    (:func:`apply_chat_template`) when it has one, else each conversation's
    :func:`plain_transcript` encoded as a plain prompt (with the tokenizer's BOS, if it
    adds one). What the benchmarks and ``osd draft build`` ask a base model."""
    conversations = validate_conversations(conversations)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return apply_chat_template(tokenizer, conversations)
    if tokenizer is None:
        raise ValueError("encode_chat needs a tokenizer")
    return [list(tokenizer(plain_transcript(c))["input_ids"]) for c in conversations]
