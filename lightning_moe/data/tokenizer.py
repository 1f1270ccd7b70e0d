"""Tokenizer loading, a small trainable byte-level BPE, and chat-template assistant masks.

Any Hugging Face tokenizer directory or hub id loads through ``AutoTokenizer``. Assistant-token
masks come from the chat template's ``{% generation %}`` blocks when the template has them, and
otherwise from rendering conversation prefixes: the text added by an assistant turn is the text
between ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i + 1])``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lightning_moe.io.atomic import atomic_directory
from lightning_moe.models.hub import local_dir_or_hub_id, not_fetched

# ChatML-style template. The assistant turn, including its end-of-turn token, sits in a
# `{% generation %}` block so `apply_chat_template(..., return_assistant_tokens_mask=True)` marks it.
# The header ends with a newline outside the block, so no token straddles the block's start.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]


def train_bpe_tokenizer(texts: Iterable[str], output_dir: str, vocab_size: int = 4096) -> None:
    """Train a byte-level BPE tokenizer on ``texts`` and save it as a transformers tokenizer directory.

    The directory holds ``tokenizer.json`` and ``tokenizer_config.json`` with ``<s>``/``</s>``/``<pad>``
    as bos/eos/pad and :data:`CHAT_TEMPLATE` as the chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=CHAT_TOKENS, chat_template=CHAT_TEMPLATE, model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    # The chat template goes inline into tokenizer_config.json (older transformers read only that),
    # and the generic fast-tokenizer class name loads in transformers 4 and 5 alike.
    with atomic_directory(output_dir, overwrite=True) as tmp:
        hf.save_pretrained(str(tmp), save_jinja_files=False)
        config_path = tmp / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config["chat_template"] = CHAT_TEMPLATE
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_tokenizer(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """Load a Hugging Face tokenizer from a local directory or a hub id.

    Args:
        name_or_path: tokenizer directory (with ``tokenizer.json`` / ``tokenizer_config.json``) or hub id.
        revision: hub revision (branch, tag or commit); ignored for local directories.
        trust_remote_code: passed to ``AutoTokenizer``.
    """
    from transformers import AutoTokenizer

    found = local_dir_or_hub_id(name_or_path, "tokenizer")
    is_local = isinstance(found, Path)
    try:
        return AutoTokenizer.from_pretrained(
            str(found), revision=None if is_local else revision, trust_remote_code=trust_remote_code
        )
    except OSError as e:
        if is_local:
            raise FileNotFoundError(f"tokenizer {name_or_path!r} could not be loaded: {e}") from e
        raise FileNotFoundError(not_fetched(name_or_path, "tokenizer", e)) from e


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes for ``tokenizer`` (a tokenizer or processor), by name: what a
    checkpoint carries so that its exports and ``generate`` have the run's tokenizer."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {path.name: path.read_bytes() for path in sorted(Path(tmp).iterdir()) if path.is_file()}


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template ends an assistant turn with (``<|im_end|>``, ``<|eot_id|>``), or None
    without a chat template: where a chat model's generation stops."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    try:
        prompt = tokenizer.apply_chat_template(turn[:1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(turn, tokenize=False)
    except Exception:  # noqa: BLE001  (templates that refuse this conversation have no turn end to find)
        return None
    if not full.startswith(prompt):
        return None
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return next((i for i in tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"] if i in special),
                None)


def generation_defaults(tokenizer: Any) -> dict[str, Any]:
    """``generation_config.json`` entries of a model trained with ``tokenizer``: its bos, pad and end tokens
    (eos, and the chat template's end of turn)."""
    ends = [t for t in (tokenizer.eos_token_id, end_of_turn_id(tokenizer)) if t is not None]
    ends = list(dict.fromkeys(ends))
    defaults = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": pad_token_id(tokenizer),
                "eos_token_id": ends[0] if len(ends) == 1 else ends or None}
    return {key: value for key, value in defaults.items() if value is not None}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of the tokenizer's vocabulary, merges, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: the vocabulary is what defines it
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, getattr(tokenizer, "chat_template", None)]
    h.update(json.dumps(extra, default=str).encode())
    return h.hexdigest()[:16]


def pad_token_id(tokenizer: Any) -> int:
    """The pad id, falling back to eos (pads never carry loss nor attention, so any id works)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def has_generation_blocks(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def chat_tokens_and_assistant_spans(
    tokenizer: Any, messages: Sequence[dict[str, Any]], method: str = "auto"
) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokenize a conversation with the chat template; return ``(ids, [(start, end) per assistant turn])``.

    Spans are token index ranges, one per assistant message in order. ``method`` is ``"generation"``
    (template ``{% generation %}`` blocks), ``"prefix"`` (render prefixes) or ``"auto"``.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat_template; the 'messages' format needs one")
    if method == "auto":
        method = "generation" if has_generation_blocks(tokenizer) else "prefix"
    n_assistant = sum(1 for m in messages if m["role"] == "assistant")
    if method == "generation":
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = list(out["input_ids"])
        spans = _runs(out["assistant_masks"])
        if len(spans) != n_assistant:
            # adjacent assistant turns could merge into one run only if the template put nothing between them
            raise ValueError(f"chat template marked {len(spans)} assistant spans for {n_assistant} assistant turns")
        return ids, spans
    if method != "prefix":
        raise ValueError(f"unknown assistant mask method {method!r} (use auto, generation or prefix)")
    full = tokenizer.apply_chat_template(list(messages), tokenize=False)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    char_spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False)
        if not full.startswith(upto) or not upto.startswith(before):
            raise ValueError("the chat template does not render conversations prefix-consistently; "
                             "assistant masks need {% generation %} blocks in this template")
        char_spans.append((len(before), len(upto)))
    spans = []
    for c0, c1 in char_spans:
        toks = [t for t, (s, e) in enumerate(offsets) if e > c0 and s < c1 and e > s]
        spans.append((toks[0], toks[-1] + 1) if toks else (0, 0))
    return ids, spans


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, v in enumerate(list(mask) + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i))
            start = None
    return spans
