"""scripts/gen_rl_data.py: the RL demo's shipped files are exactly its output, and each row is
what its file promises (a sorted answer, a near-miss rejected reply, no prompt in two files)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT, load_script


def test_shipped_rl_files_are_the_generators_output(tmp_path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_rl_data.py"), "--out",
                    str(tmp_path)], check=True, capture_output=True)  # fmt: skip
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["rl_sort_pairs.jsonl", "rl_sort_prompts.jsonl", "rl_sort_sft.jsonl",
                     "rl_sort_test.jsonl"]  # fmt: skip
    for name in names:
        assert (tmp_path / name).read_bytes() == (ROOT / "data" / name).read_bytes(), name


def test_rows_are_sorts_and_near_misses_with_no_shared_prompt(monkeypatch) -> None:
    gen = load_script("gen_rl_data", monkeypatch)
    files = gen.generate(0)
    assert files == gen.generate(0) and files != gen.generate(1)
    prompts = []
    for name, rows in files.items():
        for row in rows:
            if "prompt" in row:  # a DPO pair
                prompt, answer = row["prompt"], row["chosen"]
                rejected = row["rejected"].split()
                assert rejected != answer.split() and sorted(rejected) == answer.split()
                assert sum(a != b for a, b in zip(rejected, answer.split(), strict=True)) == 2
            else:
                prompt = row["messages"][0]["content"]
                answer = row.get("answer") or row["messages"][-1]["content"]
            letters = prompt.removeprefix("Sort: ").split()
            assert len(set(letters)) == gen.LETTERS and answer == " ".join(sorted(letters))
            prompts.append(prompt)
        assert json.loads(json.dumps(rows)) == rows, name
    assert len(prompts) == len(set(prompts)) == sum(gen.SIZES.values())
