"""A callback a CLI run lists (``--trainer.callbacks+=trained_logits.SaveTrainedOutputs``): at the end of
training it writes the trained model's logits and MTP loss sums on fixed tokens, so a test can compare exports
with the model the run itself trained."""

from __future__ import annotations

import lightning as L
import torch


def probe_tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


class SaveTrainedOutputs(L.Callback):
    def __init__(self, path: str, vocab_size: int) -> None:
        self.path, self.vocab_size = path, vocab_size

    @torch.no_grad()
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = pl_module.model.eval()
        ids = probe_tokens(self.vocab_size).to(trainer.strategy.root_device)
        labels = torch.roll(ids, -1, dims=1)
        out = model(ids, labels=labels)
        torch.save({"logits": model(ids).float().cpu(),
                    "mtp_loss_sums": [s.float().cpu() for s in out.mtp_loss_sums]}, self.path)
