"""TensorBoard opens on the loss (issue 44): it sorts tag groups (a tag's part before its first
`/`) by name and expands the first two, so the groups are named `train`, `val`, then `xray` for
the per-layer diagnostics. Before, a new user opened on `layers/activation_rms/00..07`.

`tb_order` is TensorBoard's own comparison (its webapp's `compareTagNames`: character codes, with
`/` and digits before other characters and runs of digits compared as numbers), ported so that
the test reads the tags of a real run as the dashboard lays them out."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tests.helpers import prepared_config, run_trainer


def _number_end(s: str, i: int) -> int:
    while i < len(s) and (s[i].isdigit() or s[i] == "."):
        i += 1
    return i


def _compare(a: str, b: str) -> int:
    """TensorBoard's compareTagNames, as its 2.21 webapp bundle sorts tags, for plain tags."""
    i = j = 0
    while True:
        if i == len(a):
            return 0 if j == len(b) else -1
        if j == len(b):
            return 1
        if a[i].isdigit() and b[j].isdigit():
            i2, j2 = _number_end(a, i + 1), _number_end(b, j + 1)
            x, y = float(a[i:i2]), float(b[j:j2])
            if x != y:
                return -1 if x < y else 1
            i, j = i2, j2
            continue
        first_a, first_b = a[i] == "/" or a[i].isdigit(), b[j] == "/" or b[j].isdigit()
        if first_a != first_b:
            return -1 if first_a else 1
        if a[i] != b[j]:
            return -1 if a[i] < b[j] else 1
        i, j = i + 1, j + 1


def tb_order(tags: list[str]) -> list[tuple[str, list[str]]]:
    """(group, tags) in the order the Time Series dashboard shows them."""
    groups: dict[str, list[str]] = {}
    for tag in sorted(tags, key=functools.cmp_to_key(_compare)):
        groups.setdefault(tag.split("/", 1)[0], []).append(tag)
    return list(groups.items())


def test_the_port_shows_the_issue_with_the_old_names() -> None:
    old = ["train/loss", "train/lr", "val/loss", "layers/activation_rms/00", "tasks/x/accuracy"]
    assert [g for g, _ in tb_order(old)][:2] == ["layers", "tasks"]
    assert tb_order(["a/10", "a/9", "a/b"]) == [("a", ["a/9", "a/10", "a/b"])]


def test_a_run_opens_on_its_loss_and_validation(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    task = tmp_path / "cloze.jsonl"
    rows = [{"context": "ROMEO:\nGood", "endings": [" morrow", " night"], "label": 0}] * 2
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = dict(max_steps=10, log_every=1, eval_every=5, eval_steps=1, ckpt_every=0,
                 eval_tasks=[str(task)])  # fmt: skip
    cfg = prepared_config(tmp_path, train=train)
    run_trainer(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    groups = tb_order(acc.Tags()["scalars"])
    assert [g for g, _ in groups] == ["train", "val", "xray"]
    (_, train_tags), (_, val_tags), (_, xray_tags) = groups
    # The first row of cards holds the loss and the learning rate.
    assert {"train/loss", "train/lr"} <= set(train_tags[:3]), train_tags
    assert val_tags[:3] == ["val/bits_per_byte", "val/loss", "val/perplexity"]
    assert "val/tasks/cloze/accuracy_norm" in val_tags
    assert xray_tags[0] == "xray/activation_rms/00" and "xray/update_ratio/01" in xray_tags
