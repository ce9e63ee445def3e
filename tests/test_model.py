"""The model against Hugging Face's LlamaForCausalLM, the KV cache, causality and masks."""

from __future__ import annotations

import pytest
import torch
import transformers

from minillm.config import ModelConfig
from minillm.families import from_hf_state_dict, hf_config_dict, to_hf_state_dict
from minillm.infer.engine import SamplingParams, generate
from minillm.model import KVCache, Transformer
from minillm.model.decode import Decoder
from minillm.model.rope import apply_rope, rope_rotation, rope_tables, rotate_half_matrix
from tests.helpers import assert_same_function


def make_pair(**kw) -> tuple[Transformer, transformers.LlamaForCausalLM, ModelConfig]:
    """A tiny HF Llama with random weights and our Transformer holding the same weights."""
    torch.manual_seed(0)
    base = dict(vocab_size=101, d_model=64, n_layer=2, n_head=4, ffn_hidden=96, max_seq_len=64)
    cfg = ModelConfig(**{**base, **kw})
    hf_cfg = hf_config_dict(cfg, bos_id=0, eos_id=0)
    for key in ("architectures", "model_type", "torch_dtype"):
        hf_cfg.pop(key)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).eval()
    with torch.no_grad():  # HF initialises norms to 1: make them informative
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    return ours, hf, cfg


CASES = {
    "mha-tied": dict(n_kv_head=4, tie_embeddings=True),
    "gqa-untied": dict(n_kv_head=2, tie_embeddings=False),
    "mqa-tied-theta": dict(n_kv_head=1, tie_embeddings=True, rope_theta=500.0, norm_eps=1e-6),
}
# The cache as a ring of W slots (model.sliding_window, kv_cache.py): the same contracts.
WINDOWED = {"gqa-window": dict(n_kv_head=2, tie_embeddings=False, sliding_window=4)}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf_llama(case: str) -> None:
    ours, hf, cfg = make_pair(**CASES[case])
    idx = torch.randint(0, cfg.vocab_size, (3, 40))
    with torch.no_grad():
        ref = hf(idx).logits
        got, _ = ours(idx)
    assert_same_function(got, ref)


def test_state_dict_round_trip_is_exact() -> None:
    ours, hf, cfg = make_pair(n_kv_head=2, tie_embeddings=False)
    back = to_hf_state_dict(ours.state_dict(), cfg)
    ref = hf.state_dict()
    assert set(back) == set(ref)
    for name, tensor in ref.items():
        assert torch.equal(back[name], tensor), name


def test_loss_is_mean_cross_entropy_over_non_ignored_targets() -> None:
    ours, _, cfg = make_pair()
    idx = torch.randint(0, cfg.vocab_size, (2, 10))
    targets = torch.randint(0, cfg.vocab_size, (2, 10))
    targets[0, :4] = -100
    logits, loss = ours(idx, targets)
    logp = torch.log_softmax(logits, dim=-1)
    keep = targets != -100
    picked = logp[keep].gather(1, targets[keep][:, None])
    torch.testing.assert_close(loss, -picked.mean())
    _, total = ours(idx, targets, reduction="sum")
    torch.testing.assert_close(total, -picked.sum())
    assert ours(idx)[1] is None


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_kv_cache_decoding_equals_full_forward(n_kv_head: int) -> None:
    ours, _, cfg = make_pair(n_kv_head=n_kv_head)
    idx = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        full, _ = ours(idx)
        cache = KVCache(cfg, batch_size=2, max_len=24)
        prefill, _ = ours(idx[:, :7], kv_cache=cache)  # a prompt, then one token at a time
        steps = [ours(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(7, 24)]
    assert_same_function(torch.cat([prefill, *steps], dim=1), full)


def test_chunked_prefill_equals_full_forward() -> None:
    ours, _, cfg = make_pair(n_kv_head=2)
    idx = torch.randint(0, cfg.vocab_size, (2, 30))
    with torch.no_grad():
        full, _ = ours(idx)
        cache = KVCache(cfg, batch_size=2, max_len=30)
        parts = [ours(idx[:, a:b], kv_cache=cache)[0] for a, b in ((0, 10), (10, 25), (25, 30))]
    assert_same_function(torch.cat(parts, dim=1), full)


def test_causality_future_tokens_do_not_change_the_past() -> None:
    ours, _, cfg = make_pair(n_kv_head=2)
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    changed = idx.clone()
    changed[:, 20:] = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        a, _ = ours(idx)
        b, _ = ours(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], atol=0, rtol=0)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_left_padding_matches_unpadded_rows_and_hf() -> None:
    ours, hf, cfg = make_pair(n_kv_head=2)
    lengths = [12, 7, 3]
    seqs = [torch.randint(1, cfg.vocab_size, (n,)) for n in lengths]
    T = max(lengths)
    idx = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        idx[i, T - len(s) :] = s
        mask[i, T - len(s) :] = 1
    with torch.no_grad():
        batched, _ = ours(idx, attention_mask=mask)
        ref = hf(idx, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            alone, _ = ours(s[None])
            assert_same_function(batched[i, T - len(s) :], alone[0])
    assert torch.isfinite(batched).all()
    real = mask.bool()
    assert_same_function(batched[real], ref[real])


def test_all_masked_query_rows_give_zero_attention_output_not_nan() -> None:
    ours, _, cfg = make_pair(n_kv_head=2)
    attn = ours.blocks[0].attn
    seen = {}
    attn.wo.register_forward_hook(lambda m, inp, out: seen.setdefault("y", inp[0]))
    idx = torch.randint(1, cfg.vocab_size, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # three left pads: their queries see no real key
    logits, _ = ours(idx, attention_mask=mask)
    y = seen["y"]  # attention output before the output projection, (B, T, C)
    assert torch.isfinite(logits).all()
    assert torch.count_nonzero(y[0, :3]) == 0
    assert torch.count_nonzero(y[0, 3:]) > 0 and torch.count_nonzero(y[1]) > 0
    # Gradients stay finite through the masked rows too.
    ours.train()
    _, loss = ours(idx, idx, attention_mask=mask)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)


def test_packed_documents_attend_only_within_their_document() -> None:
    ours, _, cfg = make_pair(n_kv_head=2)
    a = torch.randint(1, cfg.vocab_size, (9,))
    b = torch.randint(1, cfg.vocab_size, (14,))
    packed = torch.cat([a, b])[None]
    doc_ids = torch.tensor([[0] * 9 + [1] * 14])
    with torch.no_grad():
        got, _ = ours(packed, doc_ids=doc_ids)
        alone_a, _ = ours(a[None])
        alone_b, _ = ours(b[None])
    assert_same_function(got[0, :9], alone_a[0])
    assert_same_function(got[0, 9:], alone_b[0])


@pytest.mark.parametrize("window", [None, 3, 6])
def test_kv_cache_rows_at_different_lengths_match_rows_decoded_alone(window: int | None) -> None:
    # Each row filled alone (cache.rows), then every row advanced together by the module
    # forward, each at its own position: the logits of rows decoded alone. With a window the
    # rows pass it at different steps, and the chunk of two reads a ring that has wrapped.
    ours, _, cfg = make_pair(n_kv_head=2, sliding_window=window)
    seqs = [torch.randint(1, cfg.vocab_size, (n,)) for n in (10, 4, 1)]
    nxt = torch.randint(1, cfg.vocab_size, (3, 5))
    with torch.no_grad():
        cache = KVCache(cfg, batch_size=3, max_len=17)
        for r, s in enumerate(seqs):
            ours(s[None], kv_cache=cache.rows(r, r + 1))
        assert cache.lengths == [10, 4, 1]
        steps = torch.cat([ours(nxt[:, t : t + 1], kv_cache=cache)[0] for t in range(5)], dim=1)
        two = ours(torch.stack([nxt[0, :2], nxt[1, :2]]), kv_cache=cache.rows(0, 2))[0]  # T > 1
        for i, s in enumerate(seqs):
            alone, _ = ours(torch.cat([s, nxt[i], nxt[i, :2]])[None])
            n = len(s)
            assert_same_function(steps[i], alone[0, n : n + 5])
            if i < 2:
                assert_same_function(two[i], alone[0, n + 5 :])
    with pytest.raises(ValueError, match="attention_mask cannot be combined with a KV cache"):
        ours(nxt, attention_mask=torch.ones_like(nxt), kv_cache=KVCache(cfg, 3))


def test_kv_cache_grows_with_what_is_in_flight() -> None:
    # No max_batch x context reservation: storage follows the rows and tokens in use, and a
    # cache whose rows have all left holds nothing.
    _, _, cfg = make_pair(n_kv_head=2)  # max_seq_len 64
    cache = KVCache(cfg)
    assert cache.nbytes() == 0 and cache.batch_size == 0
    cache.add_rows(2)
    cache.append(5)
    per_slot = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4  # k and v, fp32
    assert cache.lengths == [5, 5] and cache.nbytes() == 2 * 5 * per_slot
    cache.append(1, range(1, 2))  # row 1 alone: doubling, not one slot at a time
    assert cache.lengths == [5, 6] and cache.nbytes() == 2 * 10 * per_slot
    cache.pop_row()
    cache.pop_row()
    cache.release()
    assert cache.nbytes() == 0
    with pytest.raises(ValueError, match="full"):
        KVCache(cfg, 1).append(65)


@pytest.mark.parametrize("case", [*CASES, *WINDOWED])
def test_decoder_step_equals_forward_with_the_cache(case: str) -> None:
    # The decoding fast path against the module forward, token by token, on rows at different
    # lengths (each at its own RoPE position, stale slots masked) and on rows at one length.
    ours, _, cfg = make_pair(**{**CASES, **WINDOWED}[case])
    idx = torch.randint(1, cfg.vocab_size, (3, 9))
    nxt = torch.randint(1, cfg.vocab_size, (3, 12))
    for lengths in ((9, 9, 9), (9, 6, 1)):
        with torch.inference_mode():
            ref_cache, cache = KVCache(cfg, 3, 21), KVCache(cfg, 3, 21)
            for r, n in enumerate(lengths):
                ours(idx[r : r + 1, :n], kv_cache=ref_cache.rows(r, r + 1))
                ours(idx[r : r + 1, :n], kv_cache=cache.rows(r, r + 1))
            decoder = Decoder(ours, cache)
            for t in range(12):
                ref = ours(nxt[:, t : t + 1], kv_cache=ref_cache, last_only=True)[0][:, 0]
                got = decoder.step(nxt[:, t])
                assert_same_function(got, ref)
            assert cache.lengths == ref_cache.lengths == [n + 12 for n in lengths]
            assert_same_function(cache.k, ref_cache.k)
            assert_same_function(cache.v, ref_cache.v)
            if lengths[0] == 9:
                with pytest.raises(ValueError, match="full"):
                    decoder.step(nxt[:, 0])
    with pytest.raises(RuntimeError, match="inference"):
        Decoder(ours, KVCache(cfg, 3, 4)).step(nxt[:, 0])


@pytest.mark.parametrize("tied", [True, False])
def test_a_new_decoder_reads_weights_changed_in_place(tied: bool) -> None:
    # The Decoder's transposed copies (q/k/v, gate/up, the head) are kept per weight from one
    # Decoder to the next and made anew when a weight changes in place (an optimizer step
    # between GRPO's rollouts): a stale copy would decode with the old weights.
    ours, _, cfg = make_pair(n_kv_head=2, tie_embeddings=tied)
    idx = torch.randint(1, cfg.vocab_size, (1, 5))
    for _ in range(2):
        with torch.inference_mode():
            ref_cache, cache = KVCache(cfg, 1, 8), KVCache(cfg, 1, 8)
            ours(idx, kv_cache=ref_cache)
            ours(idx, kv_cache=cache)
            ref = ours(idx[:, :1], kv_cache=ref_cache, last_only=True)[0][:, 0]
            got = Decoder(ours, cache).step(idx[:, 0])
            assert_same_function(got, ref)
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(0.05 * torch.randn_like(p))


def test_decoder_in_bf16_tracks_the_forward() -> None:
    # bf16 weights with fp32 RoPE tables (the Decoder rotates in the tables' precision, as
    # apply_rope does), and an all-bf16 model: equal up to bf16 rounding.
    for cast_buffers in (False, True):
        ours, _, cfg = make_pair(n_kv_head=2)
        for p in ours.parameters():
            p.data = p.data.to(torch.bfloat16)
        if cast_buffers:
            ours.to(torch.bfloat16)
        idx, nxt = (
            torch.randint(1, cfg.vocab_size, (2, 6)),
            torch.randint(1, cfg.vocab_size, (2, 5)),
        )
        with torch.inference_mode():
            ref_cache = KVCache(cfg, 2, 11, dtype=torch.bfloat16)
            cache = KVCache(cfg, 2, 11, dtype=torch.bfloat16)
            ours(idx, kv_cache=ref_cache)
            ours(idx, kv_cache=cache)
            decoder = Decoder(ours, cache)
            for t in range(5):
                ref = ours(nxt[:, t : t + 1], kv_cache=ref_cache, last_only=True)[0][:, 0]
                got = decoder.step(nxt[:, t])
                assert got.dtype == torch.bfloat16
                torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
            # The keys show RoPE directly (the tiny model's logits barely depend on position).
            for a, b in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
                assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


def test_cache_overflow_and_dropout_are_refused() -> None:
    ours, _, cfg = make_pair(n_kv_head=2)
    with torch.inference_mode():
        cache = KVCache(cfg, 1, 4)
        ours(torch.ones(1, 3, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="KV cache of 4"):
            ours(torch.ones(1, 2, dtype=torch.long), kv_cache=cache)
    dropped, _, _ = make_pair(n_kv_head=2, dropout=0.1)
    with pytest.raises(ValueError, match="eval"):
        Decoder(dropped.train(), KVCache(dropped.cfg, 1, 4))
    with pytest.raises(ValueError, match="eval"):
        generate(dropped.train(), [[1, 2]], SamplingParams.greedy(2))
    Decoder(dropped.eval(), KVCache(dropped.cfg, 1, 4))  # eval mode: no dropout to miss
    assert len(generate(dropped, [[1, 2]], SamplingParams.greedy(2))[0]) == 2


def test_rope_rotation_matrix_equals_apply_rope() -> None:
    cos, sin = rope_tables(head_dim=16, max_len=50, theta=10000.0)
    pos = torch.tensor([0, 7, 49])
    x = torch.randn(3, 1, 5, 16)  # (B, T=1, H, D)
    rot = rope_rotation(cos[pos], sin[pos], rotate_half_matrix(16))
    want = apply_rope(x, cos[pos][:, None, None], sin[pos][:, None, None])
    with torch.no_grad():
        assert_same_function(x[:, 0] @ rot, want[:, 0])


def test_init_scales_residual_projections() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=256, n_layer=8, n_head=4, max_seq_len=32)
    model = Transformer(cfg)
    block = model.blocks[0]
    assert abs(block.attn.wqkv.weight.std().item() - 0.02) < 0.002
    assert abs(block.attn.wo.weight.std().item() - 0.02 / 4) < 0.0005  # 1/sqrt(2*8) = 1/4
    assert abs(block.ffn.w_down.weight.std().item() - 0.02 / 4) < 0.0005
    assert torch.equal(block.attn_norm.weight, torch.ones(256))


def test_ffn_width_rule_and_param_counts() -> None:
    # LLaMA-2-7B: 8/3 * 4096 rounded up to 256 is 11008, and the known 6,738,415,616 parameters.
    with torch.device("meta"):
        cfg = ModelConfig(vocab_size=32000, d_model=4096, n_layer=32, n_head=32,
                          tie_embeddings=False, max_seq_len=4096)  # fmt: skip
        model = Transformer(cfg)
    assert cfg.ffn_hidden == 11008
    assert model.param_count() == 6_738_415_616
    assert model.param_count(non_embedding=True) == 6_738_415_616 - 2 * 32000 * 4096


def test_tied_head_counts_once_and_flops_include_the_head() -> None:
    kw = dict(vocab_size=100, d_model=32, n_layer=2, n_head=2, ffn_hidden=64, max_seq_len=16)
    tied = Transformer(ModelConfig(**kw, tie_embeddings=True))
    untied = Transformer(ModelConfig(**kw, tie_embeddings=False))
    per_layer = 32 * 96 + 32 * 32 + 2 * 32 * 64 + 64 * 32 + 2 * 32  # qkv, o, gate/up, down, norms
    assert tied.param_count() == 100 * 32 + 2 * per_layer + 32
    assert untied.param_count() == tied.param_count() + 100 * 32
    matmul = 2 * (per_layer - 2 * 32) + 100 * 32  # the head is a matmul, the lookup is not
    assert tied.flops_per_token(16) == 6 * matmul + 12 * 2 * 32 * 16
    assert untied.flops_per_token(16) == tied.flops_per_token(16)


def _alone(model: Transformer, prompt: torch.Tensor, n_new: int, max_len: int):
    """Greedy tokens and the logits before each, decoding `prompt` alone in a one-row cache."""
    decoder = Decoder(model, KVCache(model.cfg, 1, max_len))
    logits = [decoder.prefill(0, prompt)]
    tokens = []
    for _ in range(n_new - 1):
        tokens.append(int(logits[-1].argmax()))
        logits.append(decoder.step(torch.tensor([tokens[-1]]))[0])
    tokens.append(int(logits[-1].argmax()))
    return tokens, logits


@pytest.mark.parametrize("case", ["gqa-untied", "mha-tied", "gqa-window"])
def test_continuous_batching_rows_equal_each_prompt_decoded_alone(case: str) -> None:
    # A server's schedule: prompts of different lengths join at different steps, leave after
    # different numbers of tokens, the last active row moves into a freed one, and freed rows are
    # reused; each request's logits and greedy tokens equal its prompt's decoded alone.
    ours, _, cfg = make_pair(**{**CASES, **WINDOWED}[case])
    lengths, budgets, joins = [5, 11, 3, 8, 14, 2], [9, 4, 12, 6, 5, 7], [0, 0, 1, 3, 4, 6]
    prompts = [torch.randint(1, cfg.vocab_size, (n,)) for n in lengths]
    with torch.inference_mode():
        want = [_alone(ours, p, n, 32) for p, n in zip(prompts, budgets, strict=True)]
        cache = KVCache(cfg, batch_size=3, max_len=32)
        decoder = Decoder(ours, cache)
        active: list[int] = []  # request per row, rows 0..len-1
        logits: dict[int, list[torch.Tensor]] = {}
        got: dict[int, list[int]] = {}
        freed: set[int] = set()  # rows a request has left
        reused = 0  # requests prefilled into such a row
        waiting, step = list(range(len(prompts))), 0
        while waiting or active:
            while waiting and joins[waiting[0]] <= step and len(active) < cache.batch_size:
                req = waiting.pop(0)
                row = len(active)
                reused += row in freed
                active.append(req)
                logits[req] = [decoder.prefill(row, prompts[req])]
                got[req] = [int(logits[req][-1].argmax())]
            # Requests that have all their tokens leave; the last row fills the hole.
            for req in [r for r in active if len(got[r]) == budgets[r]]:
                row, last = active.index(req), len(active) - 1
                cache.move_row(last, row)
                active[row] = active[last]
                active.pop()
                freed.update((row, last))
            if active:
                step_logits = decoder.step(torch.tensor([got[r][-1] for r in active]))
                assert step_logits.shape == (len(active), cfg.vocab_size)
                for row, req in enumerate(active):
                    logits[req].append(step_logits[row])
                    got[req].append(int(step_logits[row].argmax()))
            step += 1
        assert reused >= 2  # freed rows served later requests
        for req, (tokens, ref) in enumerate(want):
            assert got[req] == tokens, req
            for a, b in zip(logits[req], ref, strict=True):
                assert_same_function(a, b)
