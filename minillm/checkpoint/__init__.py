"""The checkpoint stage: what training writes and inference reads.

Modules: `store` (atomic checkpoints, integrity-checked loading, latest/best, `load_checkpoint`)
and `rundir` (the run lock and the choice of where a run resumes).
"""
