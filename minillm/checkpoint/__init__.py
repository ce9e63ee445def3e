"""The checkpoint stage: what training writes and inference reads, and the formats it leaves in.

Modules: `store` (atomic checkpoints, integrity-checked loading, latest/best, `load_checkpoint`),
`rundir` (the run lock), `init_from` (`train.init_from`: the config loading that applies it, and
its weights), `hf_export` (a Hugging Face folder written: `minillm export`; its weights
streamed into shards by `hf_shards`), `hf_import`
(one read: `train.init_from` and `--ckpt`), `weights` (`load_weights_into`) and `gguf_file`
(`minillm export --format gguf`: a llama.cpp GGUF file and an Ollama Modelfile).
Where a run resumes is minillm.train.resume's policy.
"""
