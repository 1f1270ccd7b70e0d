"""lightning_moe: Lightning-native training of dense, MoE and hybrid language models."""
