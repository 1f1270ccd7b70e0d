"""``lightning-moe estimate``: per-rank memory of a recipe's layout, built on fake tensors, before a job runs."""
