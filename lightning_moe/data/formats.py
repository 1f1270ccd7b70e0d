"""SFT row formats -> token ids and a loss mask.

A format turns one dataset row into ``input_ids`` and ``loss_mask`` (1 where the token is a
training target). :func:`shift_labels` then gives the package's shifted labels: ``labels[t]`` is
the target for the prediction at position ``t``, i.e. ``input_ids[t + 1]`` when that token is a
target, else -100; the last token of a sample never has a label.

Formats:
- ``messages`` (Tulu-3): chat template; loss on every assistant turn (including its end-of-turn
  token), or on the last one only.
- ``prompt_completion`` (OpenMathInstruct-2): ``prompt_template.format(**row)`` then
  ``separator + row[completion_column]`` (+ EOS); loss on the completion. With
  ``use_chat_template`` the pair becomes a user/assistant conversation instead.
- ``hellaswag``: ``ctx`` + " " + ``endings[int(label)]`` (+ EOS); loss on the ending.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_moe.data.tokenizer import chat_tokens_and_assistant_spans
from lightning_moe.models.layers.loss import IGNORE_INDEX

FORMATS = ("messages", "prompt_completion", "hellaswag")
# roles chat templates know; another (ShareGPT's "human"/"gpt", "bot", ...) would be rendered as a turn that never
# carries loss, so it is an error unless ``role_map`` names the role it stands for
ROLES = ("system", "user", "assistant", "tool")
HELLASWAG_COLUMNS = ("ctx", "endings", "label")


class RowError(ValueError):
    """A problem with one row; the caller prefixes the file and row index."""


@dataclass(frozen=True)
class SampleFormat:
    """How rows become samples. Every field is part of the tokenization cache key.

    Args:
        format: ``messages``, ``prompt_completion`` or ``hellaswag``.
        messages_column: column holding the list of ``{role, content}`` messages.
        last_turn_only: ``messages``: loss on the last assistant turn only.
        prompt_template: ``prompt_completion``: ``str.format`` template over the row's columns.
        completion_column: ``prompt_completion``: column with the target text.
        separator: text put between prompt and completion (part of the completion's tokens).
        use_chat_template: ``prompt_completion``: render prompt/completion as a user/assistant chat.
        add_bos: prepend the tokenizer's bos token to non-chat formats (chat templates add their own).
        append_eos: append the tokenizer's eos token to the completion/ending (it carries loss).
        mask_method: ``auto``, ``generation`` or ``prefix`` (see ``tokenizer.chat_tokens_and_assistant_spans``).
        role_map: ``messages``: other roles renamed to known ones, ``((from, to), ...)`` (``{gpt: assistant}``).
    """

    format: str = "messages"
    messages_column: str = "messages"
    last_turn_only: bool = False
    prompt_template: str = "{prompt}"
    completion_column: str = "completion"
    separator: str = " "
    use_chat_template: bool = False
    add_bos: bool = True
    append_eos: bool = True
    mask_method: str = "auto"
    role_map: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}; choose one of {', '.join(FORMATS)}")
        for source, target in self.role_map:
            if target not in ROLES:
                raise ValueError(f"role_map maps {source!r} to {target!r}, not one of {', '.join(ROLES)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def required_columns(self) -> list[str]:
        if self.format == "messages":
            return [self.messages_column]
        if self.format == "hellaswag":
            return list(HELLASWAG_COLUMNS)
        fields = [f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f]
        return list(dict.fromkeys([*(f.split(".")[0].split("[")[0] for f in fields), self.completion_column]))


PRESETS: dict[str, dict[str, Any]] = {
    "tulu3": {"format": "messages", "messages_column": "messages"},
    "openmathinstruct2": {
        "format": "prompt_completion", "prompt_template": "Problem: {problem} Solution:",
        "completion_column": "generated_solution", "separator": " ", "append_eos": True,
    },
    "openmathinstruct2_chat": {
        "format": "prompt_completion", "prompt_template": "{problem}", "completion_column": "generated_solution",
        "use_chat_template": True,
    },
    "hellaswag": {"format": "hellaswag"},
}


def tokenize_row(row: dict[str, Any], tokenizer: Any, fmt: SampleFormat) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` for one row; raises :class:`RowError` for bad rows."""
    if fmt.format == "messages":
        messages = _check_messages(row.get(fmt.messages_column), fmt.messages_column, dict(fmt.role_map))
        return _chat(tokenizer, messages, fmt.last_turn_only, fmt.mask_method)
    if fmt.format == "prompt_completion":
        prompt = _render_prompt(row, fmt.prompt_template)
        completion = _string(row, fmt.completion_column)
        if fmt.use_chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return _chat(tokenizer, messages, False, fmt.mask_method)
        return _prompt_and_target(tokenizer, prompt, fmt.separator + completion, fmt)
    ctx = _string(row, "ctx")
    endings, label = row.get("endings"), row.get("label")
    if not isinstance(endings, list) or not endings or not all(isinstance(e, str) for e in endings):
        raise RowError(f"column 'endings' must be a non-empty list of strings, got {_typename(endings)}")
    try:
        gold = int(label)
    except (TypeError, ValueError):
        raise RowError(f"column 'label' must be an index like \"0\"..\"{len(endings) - 1}\", got {label!r}") from None
    if not 0 <= gold < len(endings):
        raise RowError(f"column 'label' is {label!r} but there are {len(endings)} endings")
    if not endings[gold].strip():
        raise RowError(f"ending {gold} is empty")
    return _prompt_and_target(tokenizer, ctx, " " + endings[gold], fmt)


def shift_labels(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """Shifted labels: ``labels[t] = input_ids[t + 1]`` where ``loss_mask[t + 1]``, else -100."""
    n = len(input_ids)
    return [input_ids[t + 1] if loss_mask[t + 1] else IGNORE_INDEX for t in range(n - 1)] + [IGNORE_INDEX] * (n > 0)


def _chat(tokenizer: Any, messages: list[dict[str, str]], last_only: bool, method: str) -> tuple[list[int], list[int]]:
    ids, spans = chat_tokens_and_assistant_spans(tokenizer, messages, method)
    if last_only:
        spans = spans[-1:]
    mask = [0] * len(ids)
    for s, e in spans:
        mask[s:e] = [1] * (e - s)
    if not any(mask):
        raise RowError("the assistant turns produced no tokens")
    return ids, mask


def _prompt_and_target(tokenizer: Any, prompt: str, target: str, fmt: SampleFormat) -> tuple[list[int], list[int]]:
    # Prompt and target are tokenized separately so the loss boundary is exact.
    p = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    t = list(tokenizer(target, add_special_tokens=False)["input_ids"])
    if fmt.add_bos and tokenizer.bos_token_id is not None:
        p = [tokenizer.bos_token_id, *p]
    if fmt.append_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("append_eos=True but the tokenizer has no eos token")
        t.append(tokenizer.eos_token_id)
    return p + t, [0] * len(p) + [1] * len(t)


def _check_messages(messages: Any, column: str, role_map: dict[str, str]) -> list[dict[str, str]]:
    if messages is None:
        raise RowError(f"column '{column}' is missing or null")
    if not isinstance(messages, list) or not messages:
        raise RowError(f"column '{column}' must be a non-empty list of {{role, content}}, got {_typename(messages)}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(f"column '{column}' message {j} must have string 'role' and 'content', got {m!r:.80}")
        role = role_map.get(m["role"], m["role"])
        if role not in ROLES:
            raise RowError(f"column '{column}' message {j} has role {m['role']!r}, not one of {', '.join(ROLES)} "
                           f"(map it with role_map, e.g. {{{m['role']}: assistant}})")
        out.append({"role": role, "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise RowError(f"column '{column}' has no assistant turn (roles: {', '.join(m['role'] for m in out)})")
    for j, m in enumerate(out):
        if m["role"] == "assistant" and not m["content"].strip():
            raise RowError(f"column '{column}' message {j}: empty assistant content")
    return out


def _string(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if value is None:
        raise RowError(f"column '{column}' is missing or null")
    if not isinstance(value, str):
        raise RowError(f"column '{column}' must be a string, got {_typename(value)}")
    if not value.strip():
        raise RowError(f"column '{column}' is empty")
    return value


def _render_prompt(row: dict[str, Any], template: str) -> str:
    for _, field, _, _ in string.Formatter().parse(template):
        if field:
            _string(row, field.split(".")[0].split("[")[0])
    return template.format(**row)


def _typename(value: Any) -> str:
    return type(value).__name__
