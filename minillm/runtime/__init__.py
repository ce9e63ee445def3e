"""The runtime stage: what every command needs from the machine.

Modules: `device` (device, precision, autocast, RNG, signals), `files` (atomic writes and staged
directories), `progress` (the one progress bar), `perf` (FLOP/s peaks and MFU).
"""
