"""The training stage: `Trainer` and what it is made of.

Modules: `trainer` (the loop), `setup` (resolving a run's config and starting weights), `optim`
(AdamW, or Muon plus AdamW), `schedule` (the learning-rate schedule), `distributed` and
`parallel` (torchrun, DDP, FSDP2), `monitor` (TensorBoard and the console), `diagnostics`
(per-layer numbers).
"""
