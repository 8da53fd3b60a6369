"""Batched next-token selection: logits processors, warpers, seeded sampling, logprobs.

One :class:`Sampler` call handles a whole batch whose rows may each use different parameters.
Everything is vectorised over the batch with per-row parameter tensors; the only device-to-host
transfer is one copy of the packed results at the very end, so on a GPU the step does not stall
the host before the sampled ids are needed anyway.

Processing order per row (the order of HF ``generate`` / TGI):

1. repetition penalty over the whole history (prompt + generated), CTRL rule: a positive logit is
   divided by the penalty, a negative one multiplied;
2. frequency penalty: ``logit -= penalty * count`` where ``count`` is the token's number of
   occurrences in the *generated* part only (OpenAI's definition: the prompt is the user's text,
   penalising it would punish the model for repeating the question's words in its answer);
3. watermark bias (:mod:`shard.engine.watermark`), seeded by the previous token;

   -> **logprobs** (and the top-n alternatives) are ``log_softmax`` of the logits at this point:
   after penalties and watermark, before temperature and truncation. They describe the model's
   (processed) distribution rather than the sampling-time one, so they are comparable across
   requests with different temperatures; with no processors they equal ``log_softmax(logits)``;

4. sampling rows only: temperature, top_k, top_p, typical_p, then a seeded draw. Greedy rows
   (``do_sample=False`` or ``temperature == 0``) take the argmax of the processed logits.

Seeded draws: the token at generated position ``i`` of a request (``i = generated_counts[row]``,
the number of tokens generated before it) is drawn with a fresh ``torch.Generator`` seeded from a
mix of ``(seed, i)``. A request's samples thus depend neither on its batch mates nor on whether it
was preempted and recomputed. The draw is an exponential race (``argmax p / E``, ``E ~ Exp(1)``),
which is exactly a categorical draw from ``p``; the noise rows are generated per row (one small
kernel per sampling row on CUDA: acceptable for now, a fused Philox kernel keyed by (seed, i) can
replace it later without changing results' distribution), the argmax is batched.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass

import torch

from shard.engine.watermark import Watermark

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters (the shard proto's SamplingParameters).

    Neutral values turn a processor off: temperature 1.0, top_k 0, top_p 1.0, typical_p 1.0,
    repetition_penalty 1.0, frequency_penalty 0.0.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    seed: int = 0

    @property
    def is_greedy(self) -> bool:
        """True when the row takes the argmax (temperature 0 is treated as greedy defensively)."""
        return not self.do_sample or self.temperature <= 0.0


@dataclass
class SampleOutput:
    """Per-row results of one :meth:`Sampler.sample` call, as plain Python lists.

    token_ids[i]: the chosen token; logprobs[i]: its log-probability (see module docstring);
    top_ids[i] / top_logprobs[i]: the top_n[i] most likely tokens and their log-probabilities,
    most likely first (empty when top_n[i] == 0).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def mix_seed(seed: int, position: int) -> int:
    """Deterministic 63-bit generator seed for (request seed, generated position).

    SplitMix64 finaliser over ``seed`` and ``position``: nearby inputs give unrelated seeds, so
    position i of seed s and position i+1 of seed s-1 don't share a random stream.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    """Chooses the next token of every row of a batch; see the module docstring for semantics."""

    def __init__(
        self, device: torch.device, watermark_gamma: float = 0.5, watermark_delta: float = 2.0
    ) -> None:
        self.device = torch.device(device)
        self.watermark = Watermark(gamma=watermark_gamma, delta=watermark_delta)

    def sample_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        token_histories: list[list[int]],
        generated_counts: list[int],
        top_n: list[int],
    ) -> DeviceSample:
        """Selects one token per row, on the device (nothing is read back; see read_host).

        logits: [num_seqs, vocab] float32 scores of the next token (on the model's device).
        params: per-row sampling parameters.
        token_histories: per row, prompt + generated ids so far (the last one precedes the token
            being chosen; it seeds the watermark).
        generated_counts: per row, how many tokens were generated before this one; the trailing
            ``generated_counts[i]`` ids of ``token_histories[i]`` are the generated part. It is
            also the position whose seeded generator draws this token.
        top_n: per row, how many alternatives to return (0 for none).
        """
        num_seqs, vocab = logits.shape
        if not (len(params) == len(token_histories) == len(generated_counts) == len(top_n)):
            raise ValueError(
                "params, token_histories, generated_counts and top_n must match logits"
            )
        if num_seqs != len(params):
            raise ValueError(f"logits has {num_seqs} rows but {len(params)} params were given")
        device = logits.device
        if num_seqs == 0:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return DeviceSample(empty, empty.double(), 0, 0, [])
        scores = logits.float()  # [num_seqs, vocab]

        scores = self._apply_penalties(scores, params, token_histories, generated_counts)
        wm_rows = [i for i, p in enumerate(params) if p.watermark and token_histories[i]]
        if wm_rows:
            prev = [token_histories[i][-1] for i in wm_rows]
            idx = _tensor(wm_rows, torch.long, device)
            scores = scores.index_copy(0, idx, self.watermark.apply(scores[idx], prev))

        logprobs_all = torch.log_softmax(scores, dim=-1)  # [num_seqs, vocab]
        next_ids = scores.argmax(dim=-1)  # [num_seqs], greedy for every row first

        sample_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sample_rows:
            sub = [params[i] for i in sample_rows]
            idx = _tensor(sample_rows, torch.long, device)
            warped = _warp(scores[idx], sub)  # [num_sample, vocab], -inf outside the allowed set
            positions = [generated_counts[i] for i in sample_rows]
            drawn = _exponential_race(warped, [p.seed for p in sub], positions)
            next_ids = next_ids.index_copy(0, idx, drawn)

        chosen_lp = logprobs_all.gather(1, next_ids[:, None]).squeeze(1)  # [num_seqs]
        max_n = min(max(top_n), vocab)
        if max_n > 0:
            top_lp, top_idx = logprobs_all.topk(max_n, dim=-1)  # [num_seqs, max_n], descending
        else:
            top_lp = logprobs_all.new_empty(num_seqs, 0)
            top_idx = next_ids.new_empty(num_seqs, 0)

        # One device->host copy (read_host): float64 holds int ids exactly (vocab << 2**53) and
        # float32 logprobs without loss.
        packed = torch.cat(
            [
                next_ids.double(),
                chosen_lp.double(),
                top_idx.double().flatten(),
                top_lp.double().flatten(),
            ]
        )
        return DeviceSample(next_ids, packed, num_seqs, max_n, list(top_n))

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        token_histories: list[list[int]],
        generated_counts: list[int],
        top_n: list[int],
    ) -> SampleOutput:
        """Selects one token per row and reads the results to the host (sample_device, then
        read_host with a blocking copy)."""
        dev = self.sample_device(logits, params, token_histories, generated_counts, top_n)
        return read_host(dev, dev.packed.cpu())

    def _apply_penalties(
        self,
        scores: torch.Tensor,
        params: list[SamplingParams],
        histories: list[list[int]],
        generated_counts: list[int],
    ) -> torch.Tensor:
        """Repetition then frequency penalty; rows with neutral values are left bit-identical."""
        num_seqs, vocab = scores.shape
        device = scores.device
        rep = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in rep):
            # Rows without the penalty contribute no ids, so one long prompt elsewhere in the
            # batch costs them nothing.
            used = [h if r != 1.0 else [] for h, r in zip(histories, rep)]
            flat = _flat_ids(used, vocab, device)  # [total_ids], row * (vocab + 1) + id
            present = torch.zeros(num_seqs * (vocab + 1), dtype=torch.bool, device=device)
            present.index_fill_(0, flat, True)
            present = present.view(num_seqs, vocab + 1)[:, :vocab]  # [n, vocab]
            penalty = _tensor(rep, scores.dtype, device)[:, None]  # [n, 1]
            penalised = torch.where(scores > 0, scores / penalty, scores * penalty)
            scores = torch.where(present, penalised, scores)
        freq = [p.frequency_penalty for p in params]
        if any(f != 0.0 for f in freq):
            generated = [
                h[len(h) - c :] if c > 0 and f != 0.0 else []
                for h, c, f in zip(histories, generated_counts, freq)
            ]
            flat = _flat_ids(generated, vocab, device)  # [total_ids]
            counts = torch.zeros(num_seqs * (vocab + 1), dtype=scores.dtype, device=device)
            counts.index_add_(0, flat, torch.ones_like(flat, dtype=scores.dtype))
            counts = counts.view(num_seqs, vocab + 1)[:, :vocab]  # [n, vocab]
            penalty = _tensor(freq, scores.dtype, device)[:, None]  # [n, 1]
            scores = scores - penalty * counts
        return scores


@dataclass
class DeviceSample:
    """What sample_device left on the device: the chosen ids (for the next step's inputs) and
    the packed results of the whole batch, read to the host with one copy."""

    next_ids: torch.Tensor  # [num_seqs] int64 on the device
    # [2 * num_seqs + 2 * num_seqs * max_n] float64: ids, logprobs, top ids, top logprobs
    packed: torch.Tensor
    num_seqs: int
    max_n: int
    top_n: list[int]


def read_host(dev: DeviceSample, packed: torch.Tensor) -> SampleOutput:
    """SampleOutput of a DeviceSample, given its packed results copied to the host."""
    num_seqs, max_n, top_n = dev.num_seqs, dev.max_n, dev.top_n
    if num_seqs == 0:
        return SampleOutput([], [], [], [])
    ids_h = packed[:num_seqs].long().tolist()  # host-side conversion, no per-row int()
    lps_h = packed[num_seqs : 2 * num_seqs].tolist()
    if max_n == 0:  # the common case: no alternatives asked for
        top_ids: list[list[int]] = [[] for _ in range(num_seqs)]
        top_lps: list[list[float]] = [[] for _ in range(num_seqs)]
        return SampleOutput(ids_h, lps_h, top_ids, top_lps)
    off = 2 * num_seqs
    tops_i = packed[off : off + num_seqs * max_n].long().tolist()
    tops_l = packed[off + num_seqs * max_n :].tolist()
    top_ids = []
    top_lps = []
    for row, n in enumerate(top_n):
        n = min(n, max_n)
        start = row * max_n
        top_ids.append(tops_i[start : start + n])
        top_lps.append(tops_l[start : start + n])
    return SampleOutput(ids_h, lps_h, top_ids, top_lps)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copies a host tensor to ``device`` without making the host wait for the device.

    A plain ``.to("cuda")`` from pageable memory synchronises the stream (the host would wait for
    the queued forward pass); from pinned memory with ``non_blocking`` it is queued like a kernel.
    PyTorch's pinned caching allocator keeps the source alive until the copy has run.
    """
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-row parameter tensor [len(values)] on ``device`` (see host_to_device)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def _flat_ids(rows: list[list[int]] | list[array], vocab: int, device: torch.device) -> torch.Tensor:
    """Flattens per-row id lists to indices into a [len(rows), vocab + 1] table, int64 [total].

    Index = row * (vocab + 1) + id. Ids outside [0, vocab) go to the row's spare last column,
    which callers drop: an out-of-range id would otherwise be a device-side assert on CUDA,
    taking the whole shard down for one bad request. Conversion goes through ``array`` (one
    C-level pass over the ints) because histories can hold many thousands of ids per row.
    """
    lengths = [len(r) for r in rows]
    if sum(lengths) == 0:
        return host_to_device(torch.zeros(0, dtype=torch.long), device)
    if all(isinstance(r, array) and r.typecode == "q" for r in rows if r):
        # int64 arrays (the engine's histories): concatenated as bytes, one memcpy per row.
        buf = bytearray().join(r for r in rows if r)
        ids = torch.frombuffer(buf, dtype=torch.long)
    else:
        ids = torch.frombuffer(array("q", itertools.chain.from_iterable(rows)), dtype=torch.long)
    # The element-wise work runs on the device: only the raw ids cross (one H2D copy), and
    # output_size keeps repeat_interleave from synchronising to learn its length.
    ids = host_to_device(ids, device)
    ids = ids.masked_fill((ids < 0) | (ids >= vocab), vocab)
    row = torch.repeat_interleave(
        torch.arange(len(rows), device=device), _tensor(lengths, torch.long, device),
        output_size=ids.shape[0],
    )  # [total]
    return row * (vocab + 1) + ids


def _warp(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top_k, top_p, typical_p for sampling rows; scores [n, vocab] -> [n, vocab].

    Tokens outside a row's allowed set become -inf. Each warper runs only when some row uses it
    and leaves rows with the neutral value unchanged.
    """
    vocab = scores.shape[-1]
    device = scores.device
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        scores = scores / _tensor(temps, scores.dtype, device)[:, None]

    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in ks):
        sorted_desc = scores.sort(dim=-1, descending=True).values  # [n, vocab]
        k_idx = _tensor(ks, torch.long, device)[:, None] - 1  # [n, 1]
        kth = sorted_desc.gather(1, k_idx)  # [n, 1]; ties with the k-th are kept
        scores = scores.masked_fill(scores < kth, float("-inf"))

    top_ps = [p.top_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        active = _tensor([tp < 1.0 for tp in top_ps], torch.bool, device)[:, None]  # [n, 1]
        top_p = _tensor(top_ps, scores.dtype, device)[:, None]
        sorted_asc, order = scores.sort(dim=-1)  # ascending: the kept nucleus is at the end
        cum = sorted_asc.softmax(dim=-1).cumsum(dim=-1)  # [n, vocab]
        # Drop the low tail whose total mass is at most 1 - top_p; always keep the best token.
        drop_sorted = cum <= (1.0 - top_p)
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop & active, float("-inf"))

    typ = [p.typical_p for p in params]
    if any(t < 1.0 for t in typ):
        active = _tensor([t < 1.0 for t in typ], torch.bool, device)[:, None]  # [n, 1]
        mass = _tensor(typ, scores.dtype, device)[:, None]
        logp = scores.log_softmax(dim=-1)  # [n, vocab]
        entropy = -(logp.exp() * logp).nansum(dim=-1, keepdim=True)  # [n, 1]
        # Typicality: distance of each token's surprisal from the entropy; most typical first.
        shifted = (-logp - entropy).abs()  # [n, vocab]; +inf for masked tokens
        sorted_shift, order = shifted.sort(dim=-1)
        cum = logp.gather(1, order).exp().cumsum(dim=-1)  # [n, vocab]
        # Keep the most typical tokens until their mass reaches typical_p (at least one).
        last = (cum < mass).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)  # [n, 1]
        drop_sorted = sorted_shift > sorted_shift.gather(1, last)
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop & active, float("-inf"))
    return scores


def _exponential_race(scores: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """Draws one token per row from softmax(scores) [n, vocab] -> int64 [n].

    argmax(p / E) with E ~ Exp(1) i.i.d. is a categorical draw from p. Row i's noise comes from a
    generator seeded by mix_seed(seeds[i], positions[i]) only.
    """
    n, vocab = scores.shape
    device = scores.device
    probs = scores.softmax(dim=-1)  # [n, vocab]; exactly 0 outside the allowed set
    noise = torch.empty(n, vocab, dtype=torch.float32, device=device)
    for row, (seed, pos) in enumerate(zip(seeds, positions)):
        gen = torch.Generator(device=device)
        gen.manual_seed(mix_seed(seed, pos))
        noise[row].exponential_(generator=gen)
    # Exp(1) can round to 0; clamping keeps p == 0 tokens at 0 rather than NaN (0 / 0).
    noise = noise.clamp_min(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor) -> list[float]:
    """Log-probabilities of the actual next tokens at prompt positions.

    logits: [n, vocab] raw scores at n prompt positions; next_ids: [n] the token that follows each
    position. Returns log_softmax(logits)[j, next_ids[j]] for each j (no processors applied), one
    device-to-host copy.
    """
    if logits.shape[0] == 0:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    ids = next_ids.to(device=logits.device, dtype=torch.long)[:, None]  # [n, 1]
    return logp.gather(1, ids).squeeze(1).cpu().tolist()
