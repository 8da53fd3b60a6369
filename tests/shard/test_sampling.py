"""Unit tests of shard.engine.sampling and shard.engine.watermark on hand-made logits (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from shard.engine.sampling import SampleOutput, Sampler, SamplingParams, mix_seed, prompt_logprobs
from shard.engine.watermark import Watermark

CPU = torch.device("cpu")


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[list[int]] | None = None,
    counts: list[int] | None = None,
    top_n: list[int] | None = None,
    sampler: Sampler | None = None,
) -> SampleOutput:
    n = logits.shape[0]
    return (sampler or Sampler(CPU)).sample(
        logits,
        params,
        histories if histories is not None else [[1]] * n,
        counts if counts is not None else [0] * n,
        top_n if top_n is not None else [0] * n,
    )


def full_logprobs(
    logits: torch.Tensor, params: SamplingParams, history: list[int], count: int
) -> list[float]:
    """The sampler's whole processed distribution for one row (top_n = vocab), indexed by id."""
    vocab = logits.shape[-1]
    out = run(logits[None], [params], [history], [count], [vocab])
    lp = [0.0] * vocab
    for i, v in zip(out.top_ids[0], out.top_logprobs[0]):
        lp[i] = v
    return lp


def test_logprobs_match_float64_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 1000) * 4
    params = [
        SamplingParams(),
        SamplingParams(do_sample=True, seed=1),
        SamplingParams(do_sample=True, temperature=0.5, top_k=10, seed=2),
        SamplingParams(do_sample=True, top_p=0.5, typical_p=0.9, seed=3),
        SamplingParams(),
    ]
    out = run(logits, params, top_n=[5, 0, 3, 1, 0])
    ref = torch.log_softmax(logits.double(), dim=-1)
    for row, tok in enumerate(out.token_ids):
        assert abs(out.logprobs[row] - ref[row, tok].item()) < 1e-4
    for row, (ids, lps) in enumerate(zip(out.top_ids, out.top_logprobs)):
        for i, v in zip(ids, lps):
            assert abs(v - ref[row, i].item()) < 1e-4


def test_prompt_logprobs_match_reference():
    torch.manual_seed(1)
    logits = torch.randn(7, 300) * 3
    next_ids = torch.randint(0, 300, (7,))
    ref = torch.log_softmax(logits.double(), dim=-1).gather(1, next_ids[:, None]).squeeze(1)
    got = prompt_logprobs(logits, next_ids)
    assert len(got) == 7
    assert max(abs(a - b) for a, b in zip(got, ref.tolist())) < 1e-4
    assert prompt_logprobs(torch.empty(0, 300), torch.empty(0, dtype=torch.long)) == []


def test_top_n_most_likely_first():
    torch.manual_seed(2)
    logits = torch.randn(3, 64)
    out = run(logits, [SamplingParams()] * 3, top_n=[4, 0, 100])
    assert out.top_ids[1] == [] and out.top_logprobs[1] == []
    assert out.top_ids[0] == logits[0].argsort(descending=True)[:4].tolist()
    assert len(out.top_ids[2]) == 64  # clamped to the vocabulary
    for lps in out.top_logprobs:
        assert lps == sorted(lps, reverse=True)
    # The chosen (greedy) token is the first alternative.
    assert out.top_ids[0][0] == out.token_ids[0]
    assert out.top_logprobs[0][0] == pytest.approx(out.logprobs[0])


def test_greedy_is_argmax_and_temperature_zero_is_greedy():
    torch.manual_seed(3)
    logits = torch.randn(6, 257)
    params = [SamplingParams()] * 3 + [
        SamplingParams(do_sample=True, temperature=0.0, seed=s) for s in range(3)
    ]
    out = run(logits, params)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_empty_batch_and_mismatched_lengths():
    assert run(torch.empty(0, 10), []) == SampleOutput([], [], [], [])
    with pytest.raises(ValueError):
        Sampler(CPU).sample(torch.zeros(2, 10), [SamplingParams()], [[1]], [0], [0])


def test_repetition_penalty_ctrl_rule():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    lp = full_logprobs(logits, SamplingParams(repetition_penalty=2.0), [0, 1, 1], 1)
    # Positive seen logit divided, negative seen logit multiplied, unseen ones untouched.
    expected = torch.log_softmax(torch.tensor([1.0, -4.0, 1.0, 0.5], dtype=torch.float64), -1)
    assert lp == pytest.approx(expected.tolist(), abs=1e-5)
    # It changes the greedy choice away from a repeated token.
    out = run(torch.tensor([[2.0, 1.5, 0.0]]), [SamplingParams(repetition_penalty=2.0)], [[2, 0]])
    assert out.token_ids == [1]
    # Ids outside the logits' vocabulary are ignored rather than crashing the step.
    out = run(torch.tensor([[2.0, 1.5, 0.0]]), [SamplingParams(repetition_penalty=2.0)], [[99, 0]])
    assert out.token_ids == [1]


def test_frequency_penalty_counts_generated_part_only():
    logits = torch.zeros(5)
    # Prompt [3, 3, 0], generated [0, 1, 1, 1]: token 3 appears only in the prompt.
    lp = full_logprobs(logits, SamplingParams(frequency_penalty=0.5), [3, 3, 0, 0, 1, 1, 1], 4)
    expected = torch.log_softmax(torch.tensor([-0.5, -1.5, 0.0, 0.0, 0.0], dtype=torch.float64), -1)
    assert lp == pytest.approx(expected.tolist(), abs=1e-5)


def test_penalties_with_nothing_to_penalise():
    torch.manual_seed(10)
    logits = torch.randn(2, 50)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)] * 2
    # Row 0: empty history; row 1: prompt only (nothing generated, so no frequency penalty).
    out = run(logits, params, [[], [4, 5]], [0, 0], [50, 50])
    expected = logits.double().clone()
    for i in (4, 5):
        v = expected[1, i]
        expected[1, i] = v / 1.5 if v > 0 else v * 1.5
    ref = torch.log_softmax(expected, -1)
    for row in range(2):
        got = dict(zip(out.top_ids[row], out.top_logprobs[row]))
        assert [got[i] for i in range(50)] == pytest.approx(ref[row].tolist(), abs=1e-5)


def test_green_mask_rows_match_single_lists_and_are_balanced():
    mark = Watermark(gamma=0.3)
    vocab = 997
    prev = [0, 1, 2, 996, 123456789]
    mask = mark.green_mask(prev, vocab, CPU)
    assert mask.shape == (5, vocab) and mask.sum(-1).tolist() == [299] * 5
    for row, p in enumerate(prev):
        assert mask[row].nonzero().squeeze(1).tolist() == mark.green_ids(p, vocab).tolist()
    # Over many previous tokens, every token is green about gamma of the time.
    freq = mark.green_mask(list(range(2000)), vocab, CPU).float().mean(0)  # [vocab]
    assert abs(float(freq.mean()) - 0.3) < 1e-3
    assert float(freq.min()) > 0.2 and float(freq.max()) < 0.4


def test_penalties_leave_neutral_rows_bit_identical():
    torch.manual_seed(4)
    logits = torch.randn(3, 100)
    mixed = run(
        logits,
        [
            SamplingParams(),
            SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4),
            SamplingParams(),
        ],
        [[1, 2, 3], [1, 2, 3], [4, 5]],
        [1, 2, 1],
        [5, 5, 5],
    )
    solo = run(logits[[0, 2]], [SamplingParams()] * 2, [[1, 2, 3], [4, 5]], [1, 1], [5, 5])
    assert mixed.top_logprobs[0] == solo.top_logprobs[0]
    assert mixed.top_logprobs[2] == solo.top_logprobs[1]


# Probabilities chosen so that each warper's allowed set is known by hand.
PROBS = [0.5, 0.25, 0.15, 0.07, 0.03]


def typical_set(probs: list[float], mass: float) -> set[int]:
    """Reference locally typical set: most typical first until the mass reaches `mass`."""
    entropy = -sum(p * math.log(p) for p in probs)
    order = sorted(range(len(probs)), key=lambda i: abs(-math.log(probs[i]) - entropy))
    kept, total = set(), 0.0
    for i in order:
        kept.add(i)
        total += probs[i]
        if total >= mass:
            break
    return kept


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(do_sample=True, top_k=2), {0, 1}),
        (SamplingParams(do_sample=True, top_p=0.8), {0, 1, 2}),
        (SamplingParams(do_sample=True, top_p=0.8, top_k=2), {0, 1}),
        (SamplingParams(do_sample=True, typical_p=0.7), typical_set(PROBS, 0.7)),
        (SamplingParams(do_sample=True, temperature=3.0, top_k=3), {0, 1, 2}),
        (SamplingParams(do_sample=True, typical_p=0.95, top_p=0.9), {0, 1, 2}),
    ],
)
def test_warpers_never_sample_outside_allowed_set(params: SamplingParams, allowed: set[int]):
    draws = 3000
    logits = torch.tensor(PROBS).log()[None].expand(draws, -1).contiguous()
    rows = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(draws)]
    out = run(logits, rows)
    assert set(out.token_ids) == allowed  # inside the set, and every allowed token reachable
    if params.temperature == 1.0:
        # Frequencies follow the renormalised distribution (exponential race is exact).
        mass = sum(PROBS[i] for i in allowed)
        for i in allowed:
            assert out.token_ids.count(i) / draws == pytest.approx(PROBS[i] / mass, abs=0.035)


def test_unrestricted_sampling_frequencies():
    draws = 4000
    logits = torch.tensor(PROBS).log()[None].expand(draws, -1).contiguous()
    out = run(logits, [SamplingParams(do_sample=True, seed=s) for s in range(draws)])
    for i, p in enumerate(PROBS):
        assert out.token_ids.count(i) / draws == pytest.approx(p, abs=0.03)


def test_seeded_sampling_independent_of_batch_mates_and_order():
    torch.manual_seed(5)
    vocab = 1000
    target = torch.randn(vocab) * 0.1  # flat: many tokens plausible
    params = SamplingParams(do_sample=True, top_p=0.95, seed=1234)
    alone = [run(target[None], [params], [[7]], [pos]).token_ids[0] for pos in range(20)]

    others = torch.randn(4, vocab)
    mates = [
        SamplingParams(),
        SamplingParams(do_sample=True, seed=9, top_k=5),
        SamplingParams(do_sample=True, seed=1234, temperature=0.7),  # same seed, other row
        SamplingParams(do_sample=True, seed=3, repetition_penalty=1.5),
    ]
    in_batch = []
    for pos in range(20):
        logits = torch.cat([others[:2], target[None], others[2:]]).flip(0)  # target at row 2
        order = list(reversed(mates[:2] + [params] + mates[2:]))
        out = run(logits, order, [[7, 8]] * 5, [pos + 3, pos + 1, pos, 2, 0])
        in_batch.append(out.token_ids[2])
    assert alone == in_batch
    assert len(set(alone)) > 10  # positions use different random streams

    per_seed = [
        run(target[None], [SamplingParams(do_sample=True, seed=s)]).token_ids[0] for s in range(20)
    ]
    assert len(set(per_seed)) > 10  # seeds use different random streams


def test_mix_seed_is_deterministic_and_spread():
    assert mix_seed(5, 3) == mix_seed(5, 3)
    seeds = {mix_seed(s, p) for s in range(30) for p in range(30)}
    assert len(seeds) == 900
    assert all(0 <= s < 2**63 for s in seeds)
    assert mix_seed(2**64 - 1, 10**9) >= 0


def test_watermark_raises_green_mass_by_expected_amount():
    vocab, prev = 1000, 42
    mark = Watermark(gamma=0.25, delta=2.0)
    green = mark.green_ids(prev, vocab)
    assert len(green) == 250 and len(set(green.tolist())) == 250
    assert torch.equal(green, mark.green_ids(prev, vocab))  # deterministic in the previous token
    assert not torch.equal(green, mark.green_ids(prev + 1, vocab))
    sampler = Sampler(CPU, watermark_gamma=0.25, watermark_delta=2.0)

    def green_mass(logits: torch.Tensor, watermark: bool) -> float:
        out = run(
            logits[None], [SamplingParams(watermark=watermark)], [[3, prev]], [1], [vocab], sampler
        )
        return sum(
            math.exp(v)
            for i, v in zip(out.top_ids[0], out.top_logprobs[0])
            if i in set(green.tolist())
        )

    # Uniform logits: green mass goes from gamma to gamma e^d / (gamma e^d + 1 - gamma).
    e = math.exp(2.0)
    assert green_mass(torch.zeros(vocab), False) == pytest.approx(0.25, abs=1e-4)
    assert green_mass(torch.zeros(vocab), True) == pytest.approx(
        0.25 * e / (0.25 * e + 0.75), abs=1e-4
    )
    # Any logits: the odds of green are multiplied by e^delta.
    torch.manual_seed(6)
    logits = torch.randn(vocab) * 2
    before, after = green_mass(logits, False), green_mass(logits, True)
    assert (after / (1 - after)) / (before / (1 - before)) == pytest.approx(e, rel=1e-3)


def test_watermarked_text_is_detectable():
    vocab = 500
    torch.manual_seed(7)
    table = torch.randn(vocab, vocab) * 0.5  # a random "bigram model"
    sampler = Sampler(CPU)
    z = {}
    for watermark in (False, True):
        ids = [1]
        for pos in range(150):
            params = SamplingParams(do_sample=True, watermark=watermark, seed=11)
            ids.append(
                run(table[ids[-1]][None], [params], [ids], [pos], sampler=sampler).token_ids[0]
            )
        z[watermark] = sampler.watermark.z_score(ids, vocab)
    assert z[True] > 4.0
    assert abs(z[False]) < 4.0


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def mixed_batch(vocab: int) -> tuple[list[SamplingParams], list[list[int]], list[int], list[int]]:
    params = [
        SamplingParams(),
        SamplingParams(do_sample=True, seed=1, top_k=50, top_p=0.9, typical_p=0.95),
        SamplingParams(do_sample=True, seed=2, temperature=0.7, repetition_penalty=1.2),
        SamplingParams(do_sample=True, seed=3, frequency_penalty=0.5, watermark=True),
        SamplingParams(repetition_penalty=1.1, watermark=True),
    ]
    histories = [[(7 * i + j) % vocab for j in range(40 + i)] for i in range(5)]
    return params, histories, [3, 10, 0, 25, 5], [0, 3, 5, 1, 2]


@pytest.mark.gpu
@needs_cuda
def test_cuda_matches_cpu_and_syncs_once():
    torch.manual_seed(8)
    vocab = 32000
    logits = torch.randn(5, vocab) * 3
    params, histories, counts, top_n = mixed_batch(vocab)
    cpu = Sampler(CPU).sample(logits, params, histories, counts, top_n)
    cuda_logits = logits.cuda()
    sampler = Sampler(torch.device("cuda"))
    sampler.sample(cuda_logits, params, histories, counts, top_n)  # warm up kernels, allocators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning) as record:
            gpu = sampler.sample(cuda_logits, params, histories, counts, top_n)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in record if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]  # the one result copy
    # Greedy rows agree with the CPU; logprobs agree everywhere (sampled ids may differ: the CUDA
    # and CPU generators are different streams).
    for row in (0, 4):
        assert gpu.token_ids[row] == cpu.token_ids[row]
        assert gpu.top_ids[row] == cpu.top_ids[row]
    ref = torch.log_softmax(logits.double(), -1)
    assert abs(gpu.logprobs[0] - ref[0, gpu.token_ids[0]].item()) < 1e-4
    for a, b in zip(gpu.top_logprobs, cpu.top_logprobs):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_cuda_seeded_sampling_independent_of_batch():
    torch.manual_seed(9)
    vocab = 32000
    device = torch.device("cuda")
    target = (torch.randn(vocab) * 0.1).to(device)
    params = SamplingParams(do_sample=True, top_p=0.95, seed=77)
    sampler = Sampler(device)
    alone = [sampler.sample(target[None], [params], [[1]], [p], [0]).token_ids[0] for p in range(8)]
    others = torch.randn(3, vocab, device=device)
    mates = mixed_batch(vocab)[0]
    together = []
    for p in range(8):
        logits = torch.cat([others[:1], target[None], others[1:]])
        out = sampler.sample(
            logits, [mates[1], params, mates[2], mates[3]], [[1]] * 4, [5, p, 0, 9], [0] * 4
        )
        together.append(out.token_ids[1])
    assert alone == together


@pytest.mark.gpu
@needs_cuda
def test_cuda_green_lists_equal_cpu():
    mark = Watermark()
    prev = [0, 5, 31999, 128000]
    cuda = mark.green_mask(prev, 128256, torch.device("cuda")).cpu()
    assert torch.equal(cuda, mark.green_mask(prev, 128256, CPU))


def test_penalties_same_for_int64_array_and_list_histories():
    """The engine passes histories as array('q') (a memcpy fast path); lists take the generic
    path. Both, out-of-range ids and empty rows included, give identical results."""
    from array import array

    torch.manual_seed(3)
    logits = torch.randn(4, 32)
    hist = [[1, 5, 5, 31, 40, -2], [], [7] * 50, [0, 2]]
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(),
    ]
    counts = [3, 0, 20, 1]
    as_lists = run(logits, params, hist, counts, [4] * 4)
    as_arrays = run(logits, params, [array("q", h) for h in hist], counts, [4] * 4)
    assert as_lists == as_arrays
