"""The training stage: `prepare_run`, `Trainer` and what they are made of.

Modules: `run` (the run prepared once: config, init_from, batch split, data, resume point),
`trainer` (the loop), `state` (the trainer's state in and out of a checkpoint), `resume` (which
checkpoint a run continues from, what a resume may change), `batch_size` (`auto`), `packing`
(masks and chat windows), `prefetch`, `optim` (AdamW, or Muon plus AdamW), `schedule` (the
learning-rate schedule), `distributed` and `parallel` (torchrun, DDP, FSDP2), `monitor`
(TensorBoard and the console), `probes` (task scores, samples), `diagnostics` (per-layer numbers).
"""
