"""Text rows → the token batch every engine reads, and back.

A training row is ``<bos> prompt response <eos>`` right-padded to the longest row of the batch:

* ``input_ids``, ``attention_mask`` ``[B, T]``;
* ``response_mask`` ``[B, T]``: the response tokens and the closing ``<eos>`` — the tokens a policy
  is trained on (or every token after ``<bos>`` when the whole sequence is the target).

Tokenization happens on the role's ranks (each on its own data-parallel shard), not in the
controller, which never loads model code. Rows longer than the model's context are cut from the
right; how many were cut is reported, never hidden.

**Packing** puts several sequences into one row (first fit, in order) to save padding work. A
``segment_ids`` column (1, 2, ... per sequence, 0 for padding) tells the engine to restart
positions at each sequence and to mask attention across them, so a packed batch gives the same
per-token losses as the unpacked one.

**Conversations.** An SFT row may instead be a list of messages ``{"role", "content"}`` (roles
``system``, ``user``, ``assistant``, ``tool``; the format of OpenAI, TRL and verl chat data),
ending with an assistant message. Only assistant text is trained on — the same loss mask a
multi-turn rollout gives its trajectory: 1 on each assistant message's content and on the token
that closes its turn, 0 on system, user and tool messages and on the template around them.

* A tokenizer with a chat template of its own (SmolLM2's, say) renders the conversation with it,
  one message at a time: message i's piece is the text rendering ``messages[: i + 1]`` adds to
  rendering ``messages[:i]``, so the pieces join into exactly what the template gives for the whole
  conversation, and each piece is tokenized alone so an assistant's span is an exact token range.
  In an assistant piece what the template writes around the content (found by rendering the turn
  with empty content) is template tokens, except the first token after the content when it is a
  special token (the turn's end, SmolLM2's ``<|im_end|>``), which is trained on.
* The built-in byte tokenizer (whose template is only a ``role: content`` placeholder for Hugging
  Face code) and a tokenizer without a template concatenate the text as a rollout writes it:
  ``<bos>``, every message's content as written, ``<eos>`` after the last assistant message only.
  A tool message's content is the observation exactly as the env role's template renders it, so
  SFT and RL train on the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from jinja2 import TemplateError

from roles.modeling.models import CHAT_TEMPLATE
from transport.batch import TensorBatch

#: the non-tensor column of an SFT batch holding a row's conversation (None: prompt, response)
#: the roles a conversation's messages may have
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
Messages = Sequence[Mapping[str, Any]]


def encode_rows(
    tokenizer: Any,
    prompts: Sequence[str | None],
    responses: Sequence[str | None],
    max_len: int,
    response_only: bool = True,
    pack: bool = False,
    conversations: Sequence[Messages | None] | None = None,
    idle: Sequence[bool] | None = None,
) -> tuple[TensorBatch, int]:
    """Tokenize (prompt, response) pairs — or, for a row whose ``conversations`` entry is not
    None, its messages (``encode_conversation``); returns the batch and the number of rows
    truncated. ``response_only=False`` trains on every token after ``<bos>`` either way. A row
    ``idle`` marks (a copy that only keeps a dp rank busy) trains on none and is not counted."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    talks = conversations if conversations is not None else [None] * len(prompts)
    idle = idle if idle is not None else [False] * len(prompts)
    rows, masks, cut = [], [], 0
    for i, (prompt, response, messages) in enumerate(zip(prompts, responses, talks, strict=True)):
        if messages is not None:
            ids, target = encode_conversation(tokenizer, messages, f"row {i}")
        else:
            head = [bos, *tokenizer.encode(prompt, add_special_tokens=False)]
            tail = [*tokenizer.encode(response, add_special_tokens=False), eos]
            ids, target = head + tail, [0] * len(head) + [1] * len(tail)
        if not response_only:
            target = [0] + [1] * (len(ids) - 1)
        if idle[i]:
            target = [0] * len(ids)
        if len(ids) > max_len:
            ids, target, cut = ids[:max_len], target[:max_len], cut + (not idle[i])
        rows.append(ids)
        masks.append(target)
    if pack:
        return pack_rows(rows, masks, max_len, tokenizer.pad_token_id), cut
    return pad_rows(rows, masks, tokenizer.pad_token_id), cut


def encode_conversation(
    tokenizer: Any, messages: Messages, where: str = "conversation"
) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its loss mask (module docstring: 1 on assistant content
    and its turn's end). Raises ValueError, prefixed with ``where``, for a malformed one."""
    check_conversation(messages, where)
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    if renders_chat(tokenizer):
        return _templated(tokenizer, turns, where)
    return _concatenated(tokenizer, turns)


def check_conversation(messages: object, where: str = "conversation") -> None:
    """Raise ValueError naming ``where`` and the message when ``messages`` is not a list of
    ``{"role", "content"}`` maps with known roles and string content, ending with an assistant
    message."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}} maps")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}: messages[{i}] is {type(message).__name__}, not a map")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise ValueError(
                f"{where}: messages[{i}] has role {role!r}; use one of {', '.join(MESSAGE_ROLES)}"
            )
        if not isinstance(message.get("content"), str):
            state = "is missing" if message.get("content") is None else "is not a string"
            raise ValueError(f"{where}: messages[{i}] ({role}): content {state}")
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"{where}: the last message is {messages[-1]['role']!r}; a conversation to train on "
            "ends with an assistant message"
        )


def renders_chat(tokenizer: Any) -> bool:
    """Whether conversations are rendered with the tokenizer's chat template: it has one, and
    not the built-in byte tokenizer's placeholder (``roles/modeling/models.py``)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    return not (isinstance(template, str) and template.endswith(CHAT_TEMPLATE))


def _concatenated(tokenizer: Any, messages: Messages) -> tuple[list[int], list[int]]:
    ids, target = [tokenizer.bos_token_id], [0]
    for i, message in enumerate(messages):
        tokens = tokenizer.encode(message["content"], add_special_tokens=False)
        if i == len(messages) - 1:  # an assistant message (checked): the answer ends here
            tokens.append(tokenizer.eos_token_id)
        ids += tokens
        target += [int(message["role"] == "assistant")] * len(tokens)
    return ids, target


def _templated(tokenizer: Any, messages: Messages, where: str) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    target: list[int] = []

    def add(text: str, trained: int) -> list[int]:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        ids.extend(tokens)
        target.extend([trained] * len(tokens))
        return tokens

    done = ""  # what the pieces so far render
    special = set(tokenizer.all_special_ids)
    for i, message in enumerate(messages):
        rendered = _render(tokenizer, messages[: i + 1], where)
        if not rendered.startswith(done):
            raise ValueError(
                f"{where}: the chat template does not render the conversation message by "
                f"message (messages[:{i + 1}] does not extend messages[:{i}]), so assistant "
                "spans cannot be cut out of it; use a template that renders incrementally"
            )
        piece, before = rendered[len(done) :], done
        done = rendered
        if message["role"] != "assistant":
            add(piece, 0)
            continue
        start = _content_start(tokenizer, messages[:i], before, piece, message["content"], where)
        add(piece[:start], 0)
        add(message["content"], 1)
        rest = add(piece[start + len(message["content"]) :], 0)
        if rest and rest[0] in special:  # the turn's end: the model learns to stop
            target[len(target) - len(rest)] = 1
    return ids, target


def _content_start(
    tokenizer: Any, earlier: Messages, done: str, piece: str, content: str, where: str
) -> int:
    """Where an assistant message's content starts in its piece (``done``: what the ``earlier``
    messages render). The same turn rendered with empty content is the template's frame around
    it; the content sits at the first place the frame can be cut so that frame[:k] + content +
    frame[k:] is the piece."""
    empty = _render(tokenizer, [*earlier, {"role": "assistant", "content": ""}], where)
    frame = empty[len(done) :] if empty.startswith(done) else ""
    for k in range(len(frame) + 1):
        if piece[:k] != frame[:k]:
            break
        if piece[k:] == content + frame[k:]:
            return k
    raise ValueError(
        f"{where}: messages[{len(earlier)}] (assistant): the chat template does not write the "
        "content as given between the same header and end as an empty turn, so its tokens "
        "cannot be found; use a template that writes assistant content unchanged"
    )


def _render(tokenizer: Any, messages: Messages, where: str) -> str:
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    except TemplateError as error:
        raise ValueError(f"{where}: the chat template refused the conversation: {error}") from error
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
    return text


def pad_rows(
    rows: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], pad: int
) -> TensorBatch:
    """Right-pad token rows into ``input_ids`` / ``attention_mask`` / ``response_mask``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, target) in enumerate(zip(rows, targets, strict=True)):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, : len(row)] = 1
        response[i, : len(row)] = torch.tensor(target, dtype=torch.long)
    return TensorBatch.from_dict(
        {"input_ids": ids, "attention_mask": attention, "response_mask": response}
    )


def pack_rows(
    rows: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], max_len: int, pad: int
) -> TensorBatch:
    """Sequences packed first-fit into rows of at most ``max_len`` tokens, with ``segment_ids``."""
    bins: list[tuple[list[int], list[int], list[int]]] = []  # ids, targets, segment ids
    for row, target in zip(rows, targets, strict=True):
        home = next((b for b in bins if len(b[0]) + len(row) <= max_len), None)
        if home is None:
            home = ([], [], [])
            bins.append(home)
        segment = (home[2][-1] + 1) if home[2] else 1
        home[0].extend(row)
        home[1].extend(target)
        home[2].extend([segment] * len(row))
    batch = pad_rows([b[0] for b in bins], [b[1] for b in bins], pad)
    segments = torch.zeros_like(batch.tensors["input_ids"])
    for i, (_, _, seg) in enumerate(bins):
        segments[i, : len(seg)] = torch.tensor(seg, dtype=torch.long)
    return batch.union(TensorBatch.from_dict({"segment_ids": segments}))


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... restarting at each new segment of a row."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: a token sees earlier tokens of its own segment. Padding sees only
    itself, so no attention row is empty (an empty row is NaN under softmax)."""
    width = segment_ids.shape[1]
    index = torch.arange(width, device=segment_ids.device)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = index[None, :] <= index[:, None]
    return ((same & causal) | torch.eye(width, dtype=torch.bool, device=segment_ids.device))[
        :, None
    ]


def decode_rows(tokenizer: Any, batch: TensorBatch) -> tuple[list[str], list[str]]:
    """(prompt text, response text) of each row of a token batch, special tokens dropped."""
    ids, attention = batch.tensor("input_ids"), batch.tensor("attention_mask")
    response = batch.tensor("response_mask")
    prompts, responses = [], []
    for row, att, resp in zip(ids, attention.bool(), response.bool(), strict=True):
        prompts.append(tokenizer.decode(row[att & ~resp].tolist(), skip_special_tokens=True))
        responses.append(tokenizer.decode(row[resp].tolist(), skip_special_tokens=True))
    return prompts, responses


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token (where a sequence-scoring head reads)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    positions = positions.expand_as(attention_mask)
    return (positions * attention_mask.bool()).max(-1).values
