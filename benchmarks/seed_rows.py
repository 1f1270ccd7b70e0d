"""The published rows, read from their source pages as saved text: NeMo AutoModel's performance summary (tab-separated
tables with notes under each) and Megatron-Bridge's Nemotron 3.5 Lightning verification cards.

    python benchmarks/seed_rows.py SEED_DIR            # rows in published_rows.yaml that differ from the pages

Every row becomes the fields its page gives, in published_rows.yaml's names and units: table cells as published
("-" is a parallel size of 1, "NR" not recorded and left out, "~x" a number with the field named under
`approximate`), plus what the page states in words (warmup and measured steps, MTP, frozen parts, LoRA rank,
GBS/MBS in a card's expected result). `benchmarks/published_rows.yaml` keeps these fields verbatim for every row whose `seed`
names its page entry; tests/recipes/test_published_rows.py checks the two against each other.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

AUTOMODEL_PAGE = "000_650e7e03ad9d9175.txt"
MBRIDGE_PAGE = "003_686faac6434742b8.txt"
TABLE_HEADING = re.compile(r"^(?P<kind>.+?): NVIDIA (?P<gpu>H100|GB200)[^,]*, Precision: (?P<precision>\S+)$")
SECTIONS = {"Fine-Tuning Performance", "LoRA Performance", "Pre-Training Performance", "Image Generation Performance",
            "Glossary", "Configuration Files", "Version Information"}
# table column -> field (parallel sizes go under `parallel`)
COLUMNS = {"Model": "model", "Workload": "workload", "Mode": "mode", "#GPUs": "gpus", "GBS": "global_batch_size",
           "MBS": "micro_batch_size", "LBS": "local_batch_size", "GA": "grad_accumulation", "Seq Length": "seq_length",
           "Kernel Optimizations": "kernels", "Optimizer": "optimizer", "Time per Global Step (s)": "step_time_s",
           "Model TFLOPs/sec/GPU": "tflops_per_gpu", "Tokens/sec": "tokens_per_s",
           "Tokens/sec/GPU": "tokens_per_s_per_gpu", "Images/sec/GPU": "images_per_s_per_gpu"}
PARALLEL_COLUMNS = {"TP": "tp", "PP": "pp", "CP": "cp", "EP": "ep", "VP": "vp", "FSDP": "fsdp"}
TEXT_FIELDS = {"model", "workload", "mode", "kernels", "optimizer"}
NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "ten": 10}
DATASETS = [("tulu-3", "tulu-3"), ("medpix", "medpix"), ("hellaswag", "hellaswag"), ("mock", "mock"),
            ("naruto", "naruto"), ("openmathinstruct", "openmathinstruct-2"), ("megatron-indexed", "indexed"),
            ("real-data rp2", "indexed")]


def number(text: str) -> int | float:
    text = text.replace(",", "")
    return float(text) if any(c in text for c in ".e") else int(text)


def count(word: str) -> int:
    return NUMBER_WORDS[word] if word in NUMBER_WORDS else number(word)


def dataset_name(text: str) -> str | None:
    text = text.lower()
    return next((name for key, name in DATASETS if key in text), None)


# ---------------------------------------------------------------------------------------------- AutoModel tables
def table_cell(column: str, text: str, row: dict[str, Any]) -> None:
    """One cell into ``row`` under its field name."""
    if column in PARALLEL_COLUMNS:
        name = PARALLEL_COLUMNS[column]
        if text == "-":  # not used: a size of 1 (no virtual pipeline for VP)
            if name != "vp":
                row["parallel"][name] = 1
        elif text != "NR":
            row["parallel"][name] = number(text)
        return
    field = COLUMNS[column]
    if text == "NR":
        return
    if field in TEXT_FIELDS:
        row[field] = text
    elif field == "seq_length" and text == "Variable":
        row[field] = "variable"
    elif text.startswith("~"):
        row[field] = number(text[1:])
        row.setdefault("approximate", []).append(field)
    else:
        row[field] = number(text)


def steps_from_notes(model: str, notes: list[str]) -> dict[str, int]:
    """Warmup/measured/total steps a table's notes state for ``model`` (the notes' own wording)."""
    clauses = [c.strip() for note in notes for c in re.split(r"(?<=[.;])\s+", note)]
    steps: dict[str, int] = {}
    for clause in clauses:
        scoped = re.match(r"^(?P<who>[\w.\- ]+): (?P<rest>.+)$", clause)
        if scoped and scoped["who"] != model:
            continue
        rest = scoped["rest"] if scoped else clause
        found = re.search(r"(\w+) warmup and (\w+) measured steps(?:, except (.+?) \((\w+) warmup and (\w+) measured)?",
                          rest)
        if found:
            warmup, measured = found[1], found[2]
            if found[3] == model:
                warmup, measured = found[4], found[5]
            steps = {"warmup_steps": count(warmup), "measured_steps": count(measured)}
            steps["steps"] = steps["warmup_steps"] + steps["measured_steps"]
        elif found := re.search(r"([\d,]+) steps, averaging steps (\d+)-(\d+)", rest):
            first, last = int(found[2]), int(found[3])
            steps = {"steps": number(found[1]), "warmup_steps": first, "measured_steps": last - first + 1}
        elif found := re.search(r"([\d,]+)-step run", rest):
            steps = {"steps": number(found[1])}
    return steps


def table_row(heading: re.Match, header: list[str], cells: list[str], notes: list[str]) -> dict[str, Any]:
    if len(cells) != len(header):
        raise ValueError(f"{AUTOMODEL_PAGE}: table {heading[0]!r} row {cells[0]!r} has {len(cells)} cells, "
                         f"its header {len(header)}")
    row: dict[str, Any] = {"source": "automodel", "gpu": heading["gpu"], "precision": heading["precision"].lower(),
                           "parallel": {}}
    for column, text in zip(header, cells):
        table_cell(column, text.strip(), row)
    model = row["model"]
    row["table_notes"] = notes
    words = " ".join([row.get("workload", "")] + notes)
    row["dataset"] = dataset_name(row.get("workload", "")) or dataset_name(words)
    if row["dataset"] not in ("mock", None):
        row["packed"] = "packed" in row.get("workload", "").lower()
    row.update(steps_from_notes(model, notes))
    for note in notes:  # "<model prefix> uses ..." sentences about one model
        for who, what in re.findall(r"(?:^|\. )(\S+) uses (.+?)\.(?:\s|$)", note):
            if model.startswith(who) and "MTP disabled" in what:
                row["mtp"] = 0
            if model.startswith(who) and (checkpoint := re.search(r"checkpoint (\S+/\S+)", what)):
                row["checkpoint"] = checkpoint[1]
        # "<model> freezes vision; <model> and <model> freeze vision and embeddings."
        for clause in re.split(r";\s*", note.rstrip(".")):
            if frozen := re.match(r"^(?P<who>.+?) freezes? (?P<what>.+)$", clause):
                if any(model.startswith(who) for who in frozen["who"].split(" and ")):
                    row["frozen"] = sorted(frozen["what"].split(" and "))
    if lora := re.search(r"LoRA, rank (\d+)", row.get("mode", "")):
        row["lora_rank"] = int(lora[1])
    return row


def automodel_rows(text: str) -> dict[str, dict[str, Any]]:
    """``"<table heading> | <model> | <N> GPUs"`` -> the row's fields."""
    lines = text.splitlines()
    rows: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(lines):
        heading = TABLE_HEADING.match(lines[i].strip())
        if not heading:
            i += 1
            continue
        i += 1
        while not lines[i].strip():
            i += 1
        header = lines[i].split("\t")
        table: list[list[str]] = []
        i += 1
        while i < len(lines) and "\t" in lines[i]:
            table.append(lines[i].split("\t"))
            i += 1
        notes = []
        while i < len(lines) and not TABLE_HEADING.match(lines[i].strip()) and lines[i].strip() not in SECTIONS:
            if lines[i].strip():
                notes.append(lines[i].strip())
            i += 1
        for cells in table:
            row = table_row(heading, header, cells, notes)
            key = f"{heading[0]} | {row['model']} | {row['gpus']} GPUs"
            if key in rows:
                raise ValueError(f"{AUTOMODEL_PAGE}: two rows {key!r}")
            rows[key] = row
    return rows


# ---------------------------------------------------------------------------------------------- Megatron-Bridge cards
CARD_TITLE = re.compile(r"^(Import|Export|Pretrain|SFT|Long Context|LoRA|Benchmark)( · [^·]+)+$")
METRICS = {"Initial loss": "initial_loss", "Final loss": "final_loss", "Step time · last 10 avg": "step_time_s",
           "Model throughput · last 10 avg": "tflops_per_gpu", "Token throughput · last 10 avg": "tokens_per_s_per_gpu",
           "Peak allocated memory": "peak_allocated_gib", "Peak reserved memory": "peak_reserved_gib"}
# command flag -> (field, True for a parallel size)
FLAGS = {"--max_steps": ("steps", False), "--seq_length": ("seq_length", False),
         "--save_interval": ("save_interval", False), "--lr": ("lr", False), "--min_lr": ("min_lr", False),
         "--warmup_iters": ("lr_warmup_steps", False), "--recipe": ("mbridge_recipe", False), "--mode": ("mode", False),
         "--hf-model": ("hf_model", False), "--hf-revision": ("hf_revision", False), "--device": ("device", False),
         "--torch-dtype": ("torch_dtype", False), "--tp": ("tp", True), "--pp": ("pp", True), "--ep": ("ep", True),
         "--etp": ("etp", True), "--tensor_model_parallel_size": ("tp", True), "--context_parallel_size": ("cp", True),
         "--expert_model_parallel_size": ("ep", True), "--expert_tensor_parallel_size": ("etp", True)}


def metric(label: str, text: str) -> int | float:
    value = number(text.split()[0])
    return round(value / 1000, 6) if label.startswith("Step time") else value  # ms -> s


def command_fields(command: str, card: dict[str, Any]) -> None:
    words = shlex.split(command)
    flags = {w: (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True)
             for i, w in enumerate(words) if w.startswith("--")}
    for flag, (field, parallel) in FLAGS.items():
        if flag in flags:
            value = flags[flag]
            value = value if field in ("mbridge_recipe", "mode", "hf_model", "hf_revision", "device", "torch_dtype") \
                else number(value)
            (card["parallel"] if parallel else card)[field] = value
    if "--nodes" in flags:
        card["nodes"] = int(flags["--nodes"])
        if "--gpus-per-node" in flags:
            card["gpus"] = card["nodes"] * int(flags["--gpus-per-node"])
    if "--distributed-save" in flags:
        card["distributed_save"] = True
    if "--dataset" in flags:
        card["dataset"] = dataset_name(flags["--dataset"])
    if "enable_offline_packing=true" in words:
        card["packed"] = True
    if revision := re.search(r"load_kwargs=\{revision:\"?(\w+)", command):
        card["dataset_revision"] = revision[1]
    if cp_comm := re.search(r"model\.cp_comm_type=(\w+)", command):
        card["cp_comm"] = cp_comm[1]


def expected_fields(text: str, card: dict[str, Any]) -> None:
    """What a card's expected result states in words and its command does not."""
    if batch := re.search(r"GBS/MBS (\d+)/(\d+)", text):
        card["global_batch_size"], card["micro_batch_size"] = int(batch[1]), int(batch[2])
    if "cp" not in card["parallel"] and (cp := re.search(r"\bCP(\d+)\b", text)):
        card["parallel"]["cp"] = int(cp[1])
    if "cp_comm" not in card and (cp_comm := re.search(r"\bCP\d+/(\w+)", text)):
        card["cp_comm"] = cp_comm[1]  # "CP2/p2p"
    if "seq_length" not in card and (seq := re.search(r"sequence-length-([\d,]+)", text)):
        card["seq_length"] = number(seq[1])
    if "dataset" not in card and (name := dataset_name(text) or dataset_name(card.get("mbridge_recipe", ""))):
        card["dataset"] = name
    if card.get("dataset") == "openmathinstruct-2" and re.search(r"\bpacked\b", text, re.IGNORECASE):
        card["packed"] = True
    if lora := re.search(r"rank-(\d+), alpha-(\d+)", text):
        card["lora_rank"], card["lora_alpha"] = int(lora[1]), int(lora[2])
    if depths := [int(k) for k in re.findall(r"MTP-(\d+)", text)]:
        card["mtp"] = max(depths)
    if tensors := re.search(r"([\d,]+) tensors", text):
        card["tensors"] = number(tensors[1])
    if params := re.search(r"([\d,]+) parameters", text):
        card["parameters"] = number(params[1])
    if saved := re.search(r"written at steps? ([\d, and]+?)(?:\.|$| and reloads)", text):
        card["checkpoint_steps"] = [int(s) for s in re.findall(r"\d+", saved[1])]
    for words, routing in (("natural routing", "natural"), ("force-balanced", "forced"), ("forced routing", "forced")):
        if words in text:
            card["routing"] = routing


def card_fields(title: str, lines: list[str]) -> dict[str, Any]:
    card: dict[str, Any] = {"source": "mbridge", "card": title, "parallel": {}}
    i = 0
    while i < len(lines):
        label = lines[i]
        if label == "Hardware":
            card["gpu"] = None if lines[i + 1] == "not specified" else lines[i + 1]
        elif label == "Precision":
            card["precision"] = {"BF16": "bf16", "FP8 MX": "mxfp8"}[lines[i + 1]]
        elif label == "Last verified":
            card["last_verified"] = lines[i + 1]
        elif label in METRICS:
            card[METRICS[label]] = metric(label, lines[i + 1])
            if label.startswith("Step time"):
                card["averaged_steps"] = int(re.search(r"last (\d+)", label)[1])
        elif label == "Exact command":
            i += 1 + (lines[i + 1] == "Command Copy")
            card["command"] = lines[i]
            command_fields(lines[i], card)
        elif label == "Expected result":
            card["expected"] = " ".join(lines[i + 1:])
            expected_fields(card["expected"], card)
            break
        i += 1
    if not card["parallel"]:
        del card["parallel"]
    return card


def mbridge_rows(text: str) -> dict[str, dict[str, Any]]:
    """Card title (``"Pretrain · H100"``) -> the card's fields."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if CARD_TITLE.match(line) and lines[i + 1] == "✓ Verified"]
    return {lines[s]: card_fields(lines[s], lines[s + 2:end])
            for s, end in zip(starts, starts[1:] + [len(lines)])}


def seed_rows(seed_dir: Path) -> dict[str, dict[str, Any]]:
    """Every published row of the two pages, keyed by ``"<page file> | <entry>"``."""
    rows = {}
    for page, parse in ((AUTOMODEL_PAGE, automodel_rows), (MBRIDGE_PAGE, mbridge_rows)):
        path = seed_dir / page
        if not path.is_file():
            raise FileNotFoundError(f"published page {path} is missing (the seeds folder holds the sources)")
        rows.update({f"{page} | {key}": fields for key, fields in parse(path.read_text()).items()})
    return rows


# row keys that are not published fields: ours
OWN_KEYS = {"title", "seed", "recipe", "documented_in", "note", "recipe_settings"}


def differences(rows: dict[str, dict[str, Any]], seeds: dict[str, dict[str, Any]]) -> list[str]:
    """How the YAML rows differ from the pages: missing or extra rows, and every field that is not as published."""
    found = []
    by_seed = {row["seed"]: row_id for row_id, row in rows.items() if row.get("seed")}
    for key, published in seeds.items():
        if key not in by_seed:
            found.append(f"no row has seed {key!r}")
            continue
        row_id, row = by_seed[key], rows[by_seed[key]]
        ours = {k: v for k, v in row.items() if k not in OWN_KEYS}
        for field in sorted(set(ours) | set(published)):
            if ours.get(field, "<absent>") != published.get(field, "<absent>"):
                found.append(f"{row_id}: {field} is {ours.get(field, '<absent>')!r}, "
                             f"the page gives {published.get(field, '<absent>')!r}")
    found += [f"{row_id}: seed {row['seed']!r} is not an entry of the pages"
              for row_id, row in rows.items() if row.get("seed") and row["seed"] not in seeds]
    return found


def main(argv: list[str]) -> int:
    import yaml

    seed_dir = Path(argv[0]) if argv else Path(__file__).resolve().parents[1].parent / "shared" / "seeds"
    rows = yaml.safe_load(Path(__file__).with_name("published_rows.yaml").read_text())["rows"]
    found = differences(rows, seed_rows(seed_dir))
    print("\n".join(found) or f"all {len(seed_rows(seed_dir))} published rows are as their pages give them")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
