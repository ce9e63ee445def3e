"""minillm: a from-scratch, readable LLaMA-style LLM training toolkit."""

import os

__version__ = "0.1.0"

# OpenMP's worker threads (torch's intra-op pool) wait for the next parallel region by spinning,
# libgomp's default. On a machine with other work (a laptop's browser, another job) the spinning
# threads take the cores the work needs: at load 2-4 on 2 cores a 2-thread training step ran
# 3-4x slower and decoding 10x (README, "On a busy machine"; scripts/bench_wait_policy.py).
# PASSIVE threads sleep at once, which costs a wake-up per region on a quiet machine. libgomp
# reads the variable once, when torch loads it, so it is set here, before any minillm module
# imports torch; a value the user set (even empty) wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
