"""Loss masks cover exactly the assistant / completion / ending tokens, checked by decoding."""

from __future__ import annotations

import pytest

from lightning_moe.data.formats import IGNORE_INDEX, PRESETS, SampleFormat, shift_labels, tokenize_row
from lightning_moe.data.samples import read_jsonl
from lightning_moe.data.tokenizer import chat_tokens_and_assistant_spans


def _masked_runs(ids, mask):
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def test_shipped_tokenizer(tokenizer):
    assert 4000 <= len(tokenizer) <= 8192
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<s>", "</s>")
    assert "{% generation %}" in tokenizer.chat_template
    text = "The quiet garden explains the river, 42 times."
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_generation_mask_supported_by_transformers(tokenizer, tulu_rows):
    row = next(r for r in tulu_rows if sum(m["role"] == "assistant" for m in r["messages"]) >= 2)
    out = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert any(out["assistant_masks"])


@pytest.mark.parametrize("method", ["generation", "prefix"])
def test_messages_mask_is_every_assistant_turn(tokenizer, tulu_rows, method):
    fmt = SampleFormat(format="messages", mask_method=method)
    checked = 0
    for row in tulu_rows[:60]:
        ids, mask = tokenize_row(row, tokenizer, fmt)
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        runs = [tokenizer.decode(r) for r in _masked_runs(ids, mask)]
        # the prefix method also takes the template's newline after the end-of-turn token
        expected = [a + "<|im_end|>" + ("\n" if method == "prefix" else "") for a in answers]
        assert runs == expected
        # and nothing from system/user turns carries loss
        unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
        for m in row["messages"]:
            if m["role"] != "assistant":
                assert m["content"] in unmasked
        checked += len(answers) > 1
    assert checked > 5  # multi-turn rows were covered


def test_messages_last_turn_only(tokenizer, tulu_rows):
    row = next(r for r in tulu_rows if sum(m["role"] == "assistant" for m in r["messages"]) >= 2)
    ids, mask = tokenize_row(row, tokenizer, SampleFormat(format="messages", last_turn_only=True))
    runs = [tokenizer.decode(r) for r in _masked_runs(ids, mask)]
    assert runs == [row["messages"][-1]["content"] + "<|im_end|>"]


def test_openmathinstruct2_preset(tokenizer, data_dir):
    row = read_jsonl(str(data_dir / "openmathinstruct2_sample.jsonl"))[0]
    ids, mask = tokenize_row(row, tokenizer, SampleFormat(**PRESETS["openmathinstruct2"]))
    prompt = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    completion = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert prompt == f"<s>Problem: {row['problem']} Solution:"
    assert completion == " " + row["generated_solution"] + "</s>"
    assert mask == sorted(mask)  # one prompt run, then one completion run


def test_openmathinstruct2_chat_variant(tokenizer, data_dir):
    row = read_jsonl(str(data_dir / "openmathinstruct2_sample.jsonl"))[1]
    ids, mask = tokenize_row(row, tokenizer, SampleFormat(**PRESETS["openmathinstruct2_chat"]))
    runs = [tokenizer.decode(r) for r in _masked_runs(ids, mask)]
    assert runs == [row["generated_solution"] + "<|im_end|>"]
    assert row["problem"] in tokenizer.decode(ids)


def test_hellaswag_loss_on_gold_ending(tokenizer, data_dir):
    for row in read_jsonl(str(data_dir / "hellaswag_sample.jsonl"))[:20]:
        ids, mask = tokenize_row(row, tokenizer, SampleFormat(format="hellaswag"))
        ending = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert ending == " " + row["endings"][int(row["label"])] + "</s>"
        assert tokenizer.decode([t for t, m in zip(ids, mask) if not m]) == "<s>" + row["ctx"]


def test_shift_labels():
    ids, mask = [10, 11, 12, 13, 14], [0, 0, 1, 1, 0]
    assert shift_labels(ids, mask) == [IGNORE_INDEX, 12, 13, IGNORE_INDEX, IGNORE_INDEX]
    assert shift_labels([], []) == []


def test_prefix_spans_match_generation_spans(tokenizer, tulu_rows):
    for row in tulu_rows[:10]:
        ids_g, spans_g = chat_tokens_and_assistant_spans(tokenizer, row["messages"], "generation")
        ids_p, spans_p = chat_tokens_and_assistant_spans(tokenizer, row["messages"], "prefix")
        assert ids_g == ids_p
        assert [s for s, _ in spans_g] == [s for s, _ in spans_p]


def test_sample_schemas(data_dir, tulu_rows):
    assert len(tulu_rows) >= 200
    assert all(set(r) == {"id", "messages", "source"} for r in tulu_rows)
    assert any(r["messages"][0]["role"] == "system" for r in tulu_rows)
    assert any(len(r["messages"]) > 3 for r in tulu_rows)
    math_rows = read_jsonl(str(data_dir / "openmathinstruct2_sample.jsonl"))
    assert all(set(r) == {"problem", "generated_solution", "expected_answer", "problem_source"} for r in math_rows)
    assert all(isinstance(v, str) for r in math_rows for v in r.values())
    hella = read_jsonl(str(data_dir / "hellaswag_sample.jsonl"))
    keys = {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split", "split_type", "label"}
    assert all(set(r) == keys and len(r["endings"]) == 4 and r["label"] in "0123" for r in hella)
    assert all(r["ctx"] == (r["ctx_a"] + " " + r["ctx_b"]).strip() for r in hella)
