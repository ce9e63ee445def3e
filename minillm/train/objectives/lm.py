"""Next-token prediction (`train.objective: lm`, the default) over the token shards of
`minillm tokenize`.

Offers `LM` (the objective: its shards, their packing, the token-weighted loss and the
validation loss and bits per byte) and `check_data` (the shards against the tokenizer and the
config).

One optimizer step = `grad_accum` micro-batches per rank whose summed token losses are divided by
the number of target tokens of the whole global batch (with chat data, the assistant tokens only),
so the gradient equals that of one big batch of the same tokens. With `train.doc_mask` a window's
tokens attend only within their own document (minillm.data.batches.doc_ids). The batch of step s
is a pure function of (seed, s, rank, world size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from minillm.config import Config
from minillm.data.batches import MicroBatch, eval_batches, train_batch
from minillm.data.meta import load_meta, open_split, stale_data_keys
from minillm.errors import ConfigError, UserError, warn
from minillm.infer.evaluate import evaluate_tokens, metrics
from minillm.model import Transformer
from minillm.runtime.device import sum_dtype
from minillm.train.distributed import all_reduce_sum
from minillm.train.objectives.common import MicroLoss, Setup
from minillm.train.objectives.packing import Packing


def check_data(cfg: Config, meta: dict[str, Any], tokenizer_sha: str, train_tokens: int,
               warn_: bool = True) -> None:  # fmt: skip
    """Check the shards (meta.json) against the tokenizer and the config.

    A tokenizer other than the shards', another data.text_field than theirs, a vocabulary larger
    than the model's or a train split shorter than one sequence are errors; shards made from other
    data settings a warning.
    """
    if meta.get("tokenizer_sha256") not in (None, tokenizer_sha):
        raise UserError(
            f"{cfg.data.out_dir}/meta.json: shards were made with another tokenizer than "
            f"{cfg.data.tokenizer_path}; run `minillm tokenize` again"
        )
    stale = stale_data_keys(meta, cfg.data)
    if "data.text_field" in stale:
        # Not a warning: the run would record a column its shards were not made from (eval and
        # chat read data.text_field from the checkpoint's config).
        made = meta["data"]["text_field"]
        raise ConfigError(
            "data.text_field",
            f"the shards were made from {made!r}, this config names {cfg.data.text_field!r}; "
            f"set data.text_field: {made} or run `minillm tokenize CONFIG` to remake them",
            str(Path(cfg.data.out_dir) / "meta.json"),
        )
    if stale and warn_:
        warn(f"{cfg.data.out_dir}/meta.json: the shards were made with other "
             f"{', '.join(stale)} than this config's; run `minillm tokenize CONFIG` to "
             "remake them")  # fmt: skip
    vocab = int(meta["vocab_size"])
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the tokenizer's {vocab} tokens",
        )
    if train_tokens < cfg.train.seq_len + 1:
        raise ConfigError(
            "train.seq_len", f"the train split has {train_tokens} tokens, fewer than seq_len+1"
        )


class LM:
    """The next-token objective of a run: its shards (opened and checked here), their packing,
    the loss and the validation loss and bits per byte."""

    dropout = True
    console: dict[str, str] = {}
    val_labels: dict[str, str] = {}
    needs_start_weights = False  # a resume takes its own checkpoint's weights

    def loss_parts(self, own: dict[str, float]) -> dict[str, float]:
        return {}

    def __init__(self, setup: Setup) -> None:
        cfg = setup.cfg
        self.cfg, self.dist, self.device = cfg, setup.dist, setup.device
        self.meta = load_meta(cfg.data.out_dir)
        self.train_tokens = open_split(cfg.data.out_dir, "train")
        self.val_tokens = open_split(cfg.data.out_dir, "val")
        self.packing = Packing(cfg, self.meta, self.train_tokens, self.val_tokens)
        if setup.verbose and self.packing.note:
            print(self.packing.note)
        check_data(cfg, self.meta, setup.tokenizer_sha, len(self.train_tokens),
                   warn_=setup.dist.is_main)  # fmt: skip
        self.chat = bool(self.meta.get("chat"))

    def attach(self, model: Transformer) -> None:
        pass  # no reference: the loss reads the model alone

    def batches(self, step: int) -> list[MicroBatch]:
        tc = self.cfg.train
        return train_batch(
            self.train_tokens,
            seed=tc.seed,
            step=step,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            batch_size=tc.batch_size,
            grad_accum=tc.grad_accum,
            seq_len=tc.seq_len,
            **self.packing.train_kwargs(),
        )

    def prepare(self, model: Transformer, step: int, batch: list[MicroBatch]) -> list[MicroBatch]:
        return batch

    def normalisers(self, batch: list[MicroBatch]) -> torch.Tensor:
        """The target tokens (token-weighted accumulation)."""
        return torch.tensor([sum(int((m.targets != -100).sum()) for m in batch)],
                            dtype=torch.float64)  # fmt: skip

    def loss(self, model: torch.nn.Module, micro: MicroBatch, norms: torch.Tensor) -> MicroLoss:
        m = micro.to(self.device, non_blocking=True)  # asynchronous from pinned memory (CUDA)
        _, loss_sum = model(m.tokens, m.targets, doc_ids=m.doc_ids, reduction="sum")
        scale = 1.0 / float(norms[0])
        return MicroLoss(
            loss_sum * scale,
            loss_sum.detach().to(sum_dtype(loss_sum.device))[None],
            m.tokens.numel(),
        )

    def step_loss(self, totals: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        return totals[0] / float(norms[0])

    def scalars(self) -> dict[str, float]:
        return {}

    def evaluate(self, model: Transformer, autocast: Any) -> dict[str, float]:
        """Loss, perplexity and bits per byte over the first eval_steps validation batches,
        computed by `minillm eval`'s own evaluation (each rank takes its share)."""
        tc, packing = self.cfg.train, self.packing
        total, n = evaluate_tokens(
            model,
            self.val_tokens,
            tc.seq_len,
            tc.batch_size,
            self.device,
            max_batches=tc.eval_steps or None,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            autocast=autocast,
            batches=packing.val_batches(tc.seq_len, tc.batch_size, tc.eval_steps or None),
        )
        sums = all_reduce_sum(
            torch.tensor([total, n], dtype=sum_dtype(self.device), device=self.device)
        )
        total, n = sums[0].item(), max(int(sums[1].item()), 1)
        result = metrics(total, n, n * packing.val_bytes_per_target)
        return {k: result[k] for k in ("loss", "perplexity", "bits_per_byte")}

    def probe_input(self) -> torch.Tensor:
        x, _ = next(eval_batches(self.train_tokens, seq_len=self.cfg.train.seq_len, batch_size=1))
        return x
