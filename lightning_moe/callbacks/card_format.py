"""The run card's files: their names, and the Markdown table laid out like Megatron-Bridge's verification cards.

Plain Python (no torch, no Lightning), so ``lightning-moe report`` starts fast.
"""

from __future__ import annotations

from typing import Any

CARD_JSON = "run_card.json"
CARD_MARKDOWN = "run_card.md"
MAX_SERIES_ROWS = 20


def _number(value: Any, spec: str = ",.4g", unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):  # non-finite values arrive as "nan" / "inf"
        return value
    return f"{value:{spec}}{unit}"


def _params(count: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f} {suffix}"
    return str(count)


def _model(model: dict[str, Any]) -> str:
    text = model["class"]
    if "family" in model:
        text += (f" ({model['family']}, pattern `{model['pattern']}`, hidden {model['hidden_size']}, "
                 f"vocab {model['vocab_size']}, {model['attention']} attention"
                 + (f", {model['mtp_depths']} MTP depths" if model["mtp_depths"] else "") + ")")
    text += f", {_params(model['parameters'])} parameters ({_params(model['trainable_parameters'])} trainable)"
    if model.get("pretrained"):
        text += f", from `{model['pretrained']}`"
    return text


def _peak_memory(card: dict[str, Any]) -> list[tuple[str, str]]:
    rss = ("Peak process RSS", _number(card.get("peak_rss_gib"), ".2f", " GiB"))
    if card.get("peak_allocated_gib") is None:  # no device allocator (CPU): the resident set is the run's memory
        return [rss]
    return [("Peak memory allocated / reserved", f"{_number(card.get('peak_allocated_gib'), '.2f')} / "
                                                 f"{_number(card.get('peak_reserved_gib'), '.2f')} GiB"), rss]


def _unit(card: dict[str, Any]) -> str:
    """What the per-device rates are per: a GPU, or on the CPU each process (the JSON keys say ``per_gpu``)."""
    return "process" if card.get("device") in (None, "cpu") else "GPU"


def _seeds(seeds: dict[str, Any] | None) -> str:
    if not seeds:
        return "n/a"
    return (f"seed_everything {_number(seeds.get('seed_everything'), 'd')}, weights {_number(seeds.get('model'), 'd')}, "
            f"data order {_number(seeds.get('data'), 'd')}")


def _rows(card: dict[str, Any]) -> list[tuple[str, str]]:
    parallel = card.get("parallel_sizes")
    versions = ", ".join(f"{k} {v}" for k, v in card["versions"].items() if v)
    window = card.get("averaged_steps")
    mfu = card.get("mfu")
    unit = _unit(card)
    return [
        ("Status", card["status"]),
        ("Model", _model(card["model"])),
        ("Workload", card["workload"] or "n/a"),
        ("World size", f"{card['world_size']} ({card['num_nodes']} node(s), {card['strategy']})"),
        ("Parallel sizes", ", ".join(f"{k}={v}" for k, v in parallel.items()) if parallel else "n/a"),
        ("Collective bytes per step (one rank)", _comm(card.get("comm_bytes_per_step"))),
        ("Global / micro batch size", f"{_number(card['global_batch_size'])} / {_number(card['micro_batch_size'])}"),
        ("Gradient accumulation", str(card["gradient_accumulation"])),
        ("Sequence length", _number(card["seq_length"])),
        ("Precision", card["precision"]),
        ("Steps", f"{card['steps']} of {card['max_steps']}"),
        ("Seeds", _seeds(card.get("seeds"))),
        ("Initial loss", _number(card["initial_loss"], ".4f")),
        ("Final loss", _number(card["final_loss"], ".4f")),
        (f"Step time (mean of last {window} steps)" if window else "Step time", _number(card.get("step_time_s"), ".4g", " s")),
        (f"Tokens/s/{unit}", _number(card.get("tokens_per_s_per_gpu"), ",.0f")),
        (f"Label tokens/s/{unit}", _number(card.get("label_tokens_per_s_per_gpu"), ",.0f")),
        *([(f"Images/s/{unit}", _number(card["images_per_s_per_gpu"], ",.4g"))] if "images_per_s_per_gpu" in card
          else []),
        (f"Model TFLOP/s/{unit}", _number(card.get("tflops_per_gpu"), ".4g")),
        ("MFU", "n/a (device peak unknown)" if mfu is None else f"{100 * mfu:.1f} % of {card['peak_flops_per_gpu'] / 1e12:.4g} TFLOP/s"
                + (f" ({card['peak_flops_source']})" if card.get("peak_flops_source") else "")),
        ("Device", card.get("device") or "n/a"),
        ("FLOPs counted by", card.get("flops_method") or "n/a"),
        *_peak_memory(card),
        ("Skipped / NaN steps", f"{_number(card.get('skipped_steps'))} / {_number(card.get('nan_steps'))}"),
        ("Checkpoints", "<br>".join(f"`{p}`" for p in card["checkpoints"]) or "none"),
        ("Logs", "<br>".join(f"{entry['logger']}: `{entry['location']}`" for entry in card.get("loggers", []))
         or "none"),
        ("Kernel checks", _kernel_checks(card.get("kernel_checks"))),
        ("Versions", versions),
        ("Command", f"`{card['command']}`"),
        ("Started", card["started"]),
        ("Wall time", _number(card["wall_time_s"], ".1f", " s")),
    ]


def _comm(counts: dict[str, Any] | None) -> str:
    if not counts:
        return "n/a" if counts is None else "none"
    if "not counted" in counts:
        return f"n/a ({counts['not counted']})"
    return "<br>".join(f"{name}: {_number(size, ',d')} B" for name, size in counts.items())


def _kernel_checks(checks: list[dict[str, Any]] | None) -> str:
    """One entry per compiled kernel and device/dtype: ok, or what failed and what ran instead."""
    if not checks:
        return "none run"
    groups: dict[str, list[dict[str, Any]]] = {}
    for check in checks:
        groups.setdefault(f"{check['kernel']} {check['device']}/{check['dtype']}", []).append(check)
    parts = []
    for name, group in groups.items():
        failed = [c for c in group if c["status"] != "ok"]
        if failed:
            parts.append(f"{name}: {failed[0]['status']} on {failed[0]['machine']}, used {failed[0]['used']}")
        else:
            parts.append(f"{name}: ok ({len(group)} signature(s), {sum(c['seconds'] for c in group):.2f} s)")
    return "<br>".join(parts)


def _series_table(series: dict[str, list], unit: str = "GPU") -> list[str]:
    steps = series["step"]
    if not steps:
        return []
    stride = max(1, -(-len(steps) // MAX_SERIES_ROWS))
    picked = sorted(set(range(0, len(steps), stride)) | {len(steps) - 1})
    lines = ["", "## By step (numbered as the loggers number them)", "",
             f"| Step | Loss | Step time (s) | Tokens/s/{unit} | TFLOP/s/{unit} |", "|---:|---:|---:|---:|---:|"]
    for i in picked:
        lines.append(
            f"| {steps[i]} | {_number(series['loss'][i], '.4f')} | {_number(series['step_time_s'][i], '.4g')} | "
            f"{_number(series['tokens_per_s_per_gpu'][i], ',.0f')} | {_number(series['tflops_per_gpu'][i], '.4g')} |"
        )
    return lines


def _escape_pipes(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(card: dict[str, Any]) -> str:
    lines = [f"# Run card: {card['name']}", "", "| | |", "|---|---|"]
    lines += [f"| {field} | {_escape_pipes(value)} |" for field, value in _rows(card)]
    lines += _series_table(card["series"], _unit(card))
    return "\n".join(lines) + "\n"
