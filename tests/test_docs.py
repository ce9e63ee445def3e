"""The docs stay true: every config key documented, docs/config.md regenerated from the code,
links into the code pointing at files that hold the symbols they name (never at line numbers),
and the numbers, config keys and TensorBoard tags that the guides quote matching the code."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from minillm.config import SECTIONS

ROOT = Path(__file__).resolve().parent.parent


def test_every_config_field_has_a_doc() -> None:
    missing = [
        f"{name}.{f.name}"
        for name, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if len(f.metadata.get("help", "")) < 10
    ]
    assert not missing, f"config fields without a help text: {missing}"


def test_config_reference_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- links into the code

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[([^\[\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1", re.S | re.M)
LINES = re.compile(r"L(\d+)(?:-L(\d+))?")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
# Docs link to a file and name the symbol in the link text, or to a section, never to line
# numbers (they drift with every edit). docs/architecture.md still has line links, being rewritten
# with the model (issue 24): until then its line anchors are read as links to the file alone.
LINE_LINKS_TOLERATED = {ROOT / "docs" / "architecture.md"}


def _links(md: Path) -> list[tuple[str, str]]:
    """(text, target) of every markdown link outside fenced code blocks."""
    return LINK.findall(FENCE.sub("", md.read_text(encoding="utf-8")))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", md.read_text(encoding="utf-8"))):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
    return {s if i == 0 else f"{s}-{i}" for s, n in seen.items() for i in range(n)}


def _names(text: str) -> list[str]:
    """The symbols a link's text names: its backticked names (`Class.method` counts by either
    part, `f()` as f), not file names."""
    names = [n.removesuffix("()") for n in re.findall(r"`([^`]+)`", text)]
    return [n for n in names if "/" not in n and not n.endswith(".py")]


def _link_problem(md: Path, text: str, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
        return None
    path, _, fragment = target.partition("#")
    file = (md.parent / path).resolve() if path else md
    if not file.is_relative_to(ROOT):
        return "points outside the repository"
    if not file.is_file():
        return "no such file"
    if fragment and LINES.fullmatch(fragment):
        if md not in LINE_LINKS_TOLERATED:
            return "links to line numbers: link the file and name the symbol (or a section)"
    elif fragment:
        if file.suffix == ".md" and fragment in _anchors(file):
            return None
        return f"no heading #{fragment} in {file.relative_to(ROOT)}"
    if file.suffix == ".py":
        source = file.read_text(encoding="utf-8")
        missing = [
            n for n in _names(text) if n not in source and n.rsplit(".", 1)[-1] not in source
        ]
        if missing:
            return f"{', '.join(missing)} not in {file.relative_to(ROOT)}"
    return None


def test_links_from_docs_point_at_files_sections_and_names_that_exist() -> None:
    problems, code_links = [], 0
    for md in DOCS:
        for text, target in _links(md):
            problem = _link_problem(md, text, target)
            if problem:
                problems.append(f"{md.relative_to(ROOT)}: [{text}]({target}): {problem}")
            code_links += target.partition("#")[0].endswith(".py")
    assert not problems, "broken links:\n" + "\n".join(problems)
    assert code_links >= 20, f"only {code_links} links into the code: is the link pattern broken?"


def test_link_checker_catches_drift() -> None:
    md = ROOT / "docs" / "training.md"
    assert _link_problem(md, "`lr_at`", "../minillm/train/schedule.py") is None
    assert _link_problem(md, "`no_such_function`", "../minillm/train/schedule.py")
    assert _link_problem(md, "`lr_at`", "../minillm/train/schedule.py#L19-L59")  # line numbers
    assert _link_problem(md, "x", "../minillm/nope.py")
    assert _link_problem(md, "x", "config.md#no-such-heading")
    assert _link_problem(md, "x", "training.md#checkpoints-and-resume") is None
    assert _link_problem(md, "x", "https://example.com/anything") is None


# ----------------------------------------------------------------------------- facts in the docs


def test_architecture_numbers_are_minillm_info() -> None:
    from minillm.config import load_config
    from minillm.info import model_info

    info = model_info(load_config(ROOT / "configs" / "llama2-7b.yaml"))
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for key in ("params", "params_non_embedding", "flops_per_token"):
        assert f"{info[key]:,}" in text, key
        assert f'"{key}": {info[key]}' in text, key


# `section.key` in a code span, not part of a path (`minillm/model.py`) or a longer dotted name
# (`model.layers.0.mlp`, Hugging Face's parameter names); file names like `train.bin` are skipped.
CONFIG_KEY = re.compile(r"(?<![\w./-])(model|data|train|sample)\.(\w+)(?![\w.{])")
FILE_EXTENSIONS = {"py", "yaml", "md", "json", "jsonl", "bin", "pt", "safetensors", "txt", "csv"}


CONFIG_ROW = re.compile(
    r"^\| `(configs/[\w.-]+\.yaml)` \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \|$", re.M
)


def test_config_table_in_training_guide_is_minillm_info() -> None:
    from minillm.config import load_config
    from minillm.info import model_info

    rows = CONFIG_ROW.findall((ROOT / "docs" / "training.md").read_text(encoding="utf-8"))
    # A config without a model section takes its model from train.init_from (configs/rl-grpo.yaml,
    # rl-dpo.yaml): `minillm info` has nothing to count until that run exists.
    shipped = {f"configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")
               if "model" in yaml.safe_load(p.read_text(encoding="utf-8"))}  # fmt: skip
    assert {row[0] for row in rows} == shipped, "training.md's table of configs is incomplete"
    for path, *documented in rows:
        info = model_info(load_config(ROOT / path))
        actual = [
            f"{info['params']:,}",
            f"{info['flops_per_token']:,}",
            f"{info['tokens_per_step']:,}",
            f"{info['memory_bytes']['total'] / 2**30:.2f}",
        ]
        assert documented == actual, f"{path}: training.md says {documented}, minillm info {actual}"


def test_config_keys_named_in_docs_exist() -> None:
    fields = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}
    unknown = []
    for md in DOCS:
        for span in re.findall(r"`([^`\n]+)`", md.read_text(encoding="utf-8")):
            for section, key in CONFIG_KEY.findall(span):
                if key not in fields[section] and key not in FILE_EXTENSIONS:
                    unknown.append(f"{md.relative_to(ROOT)}: {section}.{key} in `{span}`")
    assert not unknown, "\n".join(unknown)


def test_tensorboard_tags_in_training_guide_are_written_by_the_code() -> None:
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    code = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "minillm").rglob("*.py"))
    tags = set(re.findall(r"`((?:train|val|xray)/\w+(?:/\w+)*?)(?:/\*|/NN)?`", text))
    assert {"train/loss", "val/bits_per_byte", "xray/update_ratio"} <= tags, tags
    for tag in tags:
        section, _, name = tag.partition("/")
        written = f'"{tag}' in code or (section == "val" and f'"{name}"' in code)
        written = written or (tag.startswith("val/tasks/NAME/") and '"val/tasks/' in code)
        assert written, f"training.md documents {tag}, which no module writes"


def test_design_lists_every_tensorboard_tag_the_code_writes() -> None:
    """docs/design.md's "TensorBoard scalars" names every literal tag of the code (issue 44: the
    moe/*, dpo/* and grpo/* ones were missing), and the groups in TensorBoard's order."""
    section = _design_section("TensorBoard scalars")
    code = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "minillm").rglob("*.py"))
    tags = set(re.findall(r'"((?:train|val|xray|dpo|grpo)/[a-z_/]*[a-z_])"', code))
    assert {"train/loss", "xray/moe/aux_loss", "dpo/loss", "grpo/reward"} <= tags, tags
    missing = sorted(t for t in tags if f"`{t}`" not in section)
    assert not missing, f"design.md's TensorBoard scalars lack {missing}"
    assert "`train` (loss and learning rate first), `val`,\nthen `xray`" in section


# ----------------------------------------------------------------------------- the contracts


def _design_section(title: str) -> str:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_design_cli_lists_every_command_and_option() -> None:
    import typer

    from minillm.cli import app

    cli = _design_section("CLI")
    group = typer.main.get_command(app)
    missing = []
    for name, command in group.commands.items():
        line = next((s for s in cli.splitlines() if s.startswith(f"minillm {name} ")), None)
        if line is None:
            missing.append(name)
            continue
        usage = " ".join(cli.split(f"minillm {name} ", 1)[1].split("\nminillm ", 1)[0].split())
        for param in command.params:
            for opt in param.opts if param.param_type_name == "option" else [param.metavar]:
                if opt.startswith("--") or param.param_type_name == "argument":
                    if opt not in usage:
                        missing.append(f"{name} {opt}")
    assert not missing, f"docs/design.md's CLI section lacks: {missing}"


def test_design_config_lists_every_key() -> None:
    config = _design_section("Config (one YAML, four sections)")
    for name, cls in SECTIONS.items():
        listed = re.search(rf"^{name}:\s*\{{([^}}]*)\}}", config, re.M)
        assert listed is not None, name
        keys = [k.strip() for k in listed.group(1).split(",")]
        assert keys == [f.name for f in dataclasses.fields(cls)], name


def test_where_things_live_names_every_module() -> None:
    """docs/architecture.md's tree names every module of the package, under its own package."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    tree = text.split("## Where things live", 1)[1].split("```", 2)[1]
    # Each top-level entry ("  data/ ...") owns the indented lines below it.
    blocks = re.split(r"\n  (?=\S)", "\n" + tree.split("minillm/", 1)[1])
    owned = {b.split()[0]: b for b in blocks if b.strip()}
    missing = []
    for path in sorted((ROOT / "minillm").rglob("*.py")):
        rel = path.relative_to(ROOT / "minillm")
        if rel.name == "__init__.py" or "__pycache__" in rel.parts:
            continue
        # The folder a module sits in (train/objectives/ inside train/), or its own name.
        key = "/".join(rel.parts[:-1]) + "/" if len(rel.parts) > 1 else rel.name
        block = owned.get(key, "") or next((b for k, b in owned.items() if k.startswith(key)), "")
        if not re.search(rf"(?<![\w.]){re.escape(rel.name)}\b", block):
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md 'Where things live' does not name: {missing}"


def test_the_first_hour_docs_agree_with_the_shipped_commands() -> None:
    """What issue 44's walk found contradicted: the openai snippet asks the chat demo a task it
    was trained on (three letters), TensorBoard is pointed at `runs` (a run's own tb/ folder is
    named `.`), the README mentions wandb, a piped `chat` is one conversation, and the guide
    does not call the demo's slow grad-norm climb a trouble sign."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    guide = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    shape = re.compile(r"(Copy|Reverse): [a-z] [a-z] [a-z]")  # the chat demo's tasks
    rows = (ROOT / "data" / "tiny_chat_test.jsonl").read_text(encoding="utf-8").splitlines()
    assert all(shape.fullmatch(json.loads(r)["messages"][-1]["content"]) for r in rows)
    asked = re.findall(r'"content": "((?:Copy|Reverse): [^"]*)"', readme)
    assert asked and all(shape.fullmatch(a) for a in asked), asked
    (logdir,) = re.findall(r"^tensorboard --logdir (\S+)", readme, re.M)
    assert not logdir.endswith("/tb"), logdir
    assert "WANDB_DIR" in readme and "train.log_to" in readme
    for md in (readme, _design_section("CLI")):
        assert "one reply per piped line" not in md and "one reply\n  per stdin line" not in md
    assert "or a steady climb, mean" not in guide and "from 0.82 to 1.78" in guide


def test_the_lora_note_on_a_few_examples_is_its_config() -> None:
    """Issue 53: README's LoRA note on overfitting a few dozen examples quotes
    configs/tiny-lora-few.yaml. Its commands name the config and the run folder the config
    writes; the counts, steps, batch and lr in the text are the config's; and its table's steps
    are the run's evaluation steps, the lowest val/loss bolded at the step the text calls the low
    (a config or table changed without the note fails here)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## LoRA: fine-tune a model you did not train\n")[1].split("\n## ")[0]
    config = yaml.safe_load((ROOT / "configs" / "tiny-lora-few.yaml").read_text(encoding="utf-8"))
    data, train = config["data"], config["train"]
    rows = (ROOT / data["source"]).read_text(encoding="utf-8").splitlines()
    assert len(rows) >= data["max_documents"] > data["val_documents"] > 0
    n_train = data["max_documents"] - data["val_documents"]
    lr = f"{train['lr']:.0e}".replace("e-0", "e-")
    for phrase in (
        f"on {n_train} of the\ncopy/reverse conversations",
        f"with the {data['val_documents']} before them held out",
        f"`data.max_documents: {data['max_documents']}`",
        f"`data.val_documents: {data['val_documents']}`",
        f"evaluated every {train['eval_every']} steps",
        "minillm tokenize configs/tiny-lora-few.yaml ",
        f"minillm train configs/tiny-lora-few.yaml      # {train['max_steps']} steps of "
        f"{train['batch_size']} x {train['seq_len']} tokens at lr {lr}",
        f"minillm eval --ckpt {train['out_dir']} --best --task",
    ):
        assert phrase in section, phrase
    assert train["eval_steps"] == 0 and train["lora"]["rank"] == 8  # "that whole split", "Rank 8"
    (steps,) = re.findall(r"^\| step \|(.*)\|$", section, re.M)
    (vals,) = re.findall(r"^\| val/loss \|(.*)\|$", section, re.M)
    steps = [int(s) for s in steps.split("|")]
    vals = [v.strip() for v in vals.split("|")]
    assert all(s % train["eval_every"] == 0 and s <= train["max_steps"] for s in steps), steps
    assert steps[-1] == train["max_steps"] and len(vals) == len(steps)
    (bold,) = [i for i, v in enumerate(vals) if v.startswith("**")]
    numbers = [float(v.strip("*")) for v in vals]
    assert numbers[bold] == min(numbers)
    assert f"val/loss is lowest at step {steps[bold]}," in section
    assert f"BEST names step {steps[bold]}'s checkpoint" in section


def _h2_slugs(md: Path) -> list[str]:
    return [_slug(h) for h in re.findall(r"^## (.+)$", FENCE.sub("", md.read_text("utf-8")), re.M)]


def test_the_readme_is_a_how_to_with_its_numbers_in_benchmarks_md() -> None:
    """Issue 53: README keeps the quickstart, the tour and each feature's how-to; the benchmarks
    and long measured discussions live in docs/benchmarks.md, each of whose sections README
    links. README's contents list links every section, the published-model recipe in bold."""
    readme_md = ROOT / "README.md"
    readme = readme_md.read_text(encoding="utf-8")
    assert len(readme.encode()) < 72_000, "README is past 72 KB: measurements go to benchmarks.md"
    contents = readme.split("\n## Contents\n")[1].split("\n## ")[0]
    linked = set(re.findall(r"\]\(#([^)]+)\)", contents))
    missing = [s for s in _h2_slugs(readme_md) if s != "contents" and s not in linked]
    assert not missing, f"README sections not in its Contents: {missing}"
    assert "**[Fine-tune a published model](#fine-tune-a-published-model)**" in contents
    pointed = set(re.findall(r"\]\(docs/benchmarks\.md#([^)]+)\)", readme))
    unlinked = set(_h2_slugs(ROOT / "docs" / "benchmarks.md")) - pointed
    assert not unlinked, f"docs/benchmarks.md sections README does not link: {unlinked}"


def test_the_readme_family_table_is_the_registry() -> None:
    """README's table of families lists every family of minillm.families, in its order, with
    the transformers class and llama.cpp architecture the family writes."""
    from minillm.families import FAMILIES

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("| `model.family` |", 1)[1].split("\n\n", 1)[0]
    rows = [
        tuple(cell.strip() for cell in line.strip("|").split("|"))
        for line in table.splitlines()[2:]
    ]
    want = [(f.name, f.hf_class, f.llama_cpp_arch) for f in FAMILIES.values()]
    assert rows == want


def test_the_ollama_formats_the_docs_list_are_the_ones_written() -> None:
    """README and design.md name the chat formats whose TEMPLATE the Modelfile gets."""
    from minillm.checkpoint.ollama import FORMATS

    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = re.search(r"the formats Ollama ships \(([^)]*)\)", design)
    assert listed, "design.md no longer lists the Modelfile's formats"
    words = " ".join(listed.group(1).split())
    names = {f.name.replace(" [INST]", "") for f in FORMATS}
    assert {n for n in names if n not in ("Mistral", "Llama 2")} <= set(
        re.split(r", | and ", words)
    )
    assert "Mistral's and Llama 2's `[INST]`" in words
    for name in names:
        assert name in " ".join(readme.split()), f"README does not name {name}"


def test_the_lora_size_rule_and_its_example_add_up() -> None:
    """README's LoRA checkpoint size: rank x (in + out) per target, 12 bytes per parameter;
    its SmolLM2-135M figures follow from the rule (tests/test_lora.py measures the bytes)."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "the checkpoint keeps 12 bytes per adapter parameter" in text
    d, q, kv, ffn, blocks, rank = 576, 576, 192, 1536, 30, 16
    per_block = rank * ((d + q + 2 * kv) + (q + d) + (d + 2 * ffn) + (ffn + d))
    total = blocks * per_block
    said = f"{per_block:,} per block, {total / 1e6:.2f}M in all, {12 * total / 1e6:.1f} MB"
    assert said in text, said
    # make test's time: one range in both places that give it
    assert "7-14 min on 2 quiet CPU cores, ~25 busy" in text
    assert "(7-14 minutes on 2 quiet cores; up to ~25 minutes on a busy machine" in text


def test_the_legacy_false_note_holds_for_the_installed_transformers(tmp_path: Path) -> None:
    """README: a sentencepiece-style tokenizer whose tokenizer_config.json says `legacy: false`
    is encoded as its tokenizer.json says (one `▁` of its own before a leading space's word),
    which transformers 5.x, rebuilding it with a Metaspace pre-tokenizer, does not do."""
    import transformers

    from minillm.tokenizer.bpe import load_tokenizer
    from tests.published import family_folder, hf_tokenizer

    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "whose tokenizer_config.json says `legacy: false` (Llama 2, TinyLlama, Phi-3)" in text
    assert "`[1, 29871, 8236, 2913]` in minillm" in text and "`[1, 8236, 2913]` in" in text
    assert f"transformers {transformers.__version__.rsplit('.', 1)[0]}" in text
    folder = family_folder(tmp_path, "llama2")  # Llama 2's specials, a Metaspace-style BPE
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(tokenizer_class="LlamaTokenizer", legacy=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours = load_tokenizer(folder / "tokenizer.json").encode(" leading space").tokens
    hf = hf_tokenizer(folder)
    theirs = hf.convert_ids_to_tokens(hf(" leading space")["input_ids"])
    assert ours[0] == theirs[0] == "<s>" and ours[1] == "▁"
    assert ours[:1] + ours[2:] == theirs  # the one `▁` transformers leaves out
